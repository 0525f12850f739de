"""Decode attention compiled for sm_90 offline (no GPU: the Triton wheel's ptxas), for what the
interpreter cannot show: the first-tile reload after the PDL wait reads through L2."""

from __future__ import annotations

import pytest

from kipp_cuda.kernels import sass
from tests.cuda.kernel_testing import compile_offline

_COMPILE = """
import triton, triton.language as tl
from triton.compiler import ASTSource
from kipp_cuda.kernels import sass
from kipp_cuda.kernels.decode_attention import _paged_decode_attention_kernel as K

PTRS = dict(out_ptr="*bf16", mid_o_ptr="*fp32", mid_lse_ptr="*fp32", counters_ptr="*i32",
            q_ptr="*bf16", k_cache_ptr="*bf16", v_cache_ptr="*bf16", k_scale_ptr="*bf16",
            v_scale_ptr="*bf16", block_tables_ptr="*i32", context_lens_ptr="*i32",
            l2_table_ptr="*i64")
sig = {n: PTRS.get(n, "i32" if n.startswith("stride") or n == "num_splits" else "constexpr")
       for n in K.arg_names}
sig["qk_scale"] = "fp32"


def ptx(prefetch, ranges=0, at_end=False):
    consts = dict(G=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_N=64, PAGE_SIZE=32, IS_Q8=False,
                  ONE_SPLIT=False, MIN_TILES=1, DOT_DTYPE=tl.bfloat16, PRECISION="tf32",
                  FUSED_MERGE=True, MERGE_H=4, BLOCK_S=64, CHUNK_S=32, MERGE_PEEL=True, PDL=True,
                  PREFETCH=prefetch, L2_RANGES=ranges, L2_AT_END=at_end)
    src = ASTSource(fn=K, signature=sig, constexprs=consts)
    return triton.compile(src, target=sass.TARGET, options=dict(num_warps=4)).asm["ptx"]
"""
_RELOAD = (
    _COMPILE
    + """
for prefetch in (False, True):
    print(sum("ld.global" in line and ".cg" in line for line in ptx(prefetch).splitlines()))
"""
)
# At the start and at the end: the PTX lines of the first weight prefetch, the PDL wait and the
# merge's atomic, and the prefetches' count with 0 and with 3 ranges.
_L2 = (
    _COMPILE
    + """
want = "cp.async.bulk.prefetch.L2"
for at_end in (False, True):
    text = ptx(True, 3, at_end).splitlines()
    first = next(i for i, t in enumerate(text) if want in t)
    wait = next(i for i, t in enumerate(text) if "griddepcontrol.wait" in t)
    atom = next(i for i, t in enumerate(text) if "atom." in t)
    none = sum(want in t for t in ptx(True, 0, at_end).splitlines())
    print(first, wait, atom, none, sum(want in t for t in text))
"""
)


@pytest.mark.skipif(not sass.available(), reason="this Triton ships no CUDA toolchain")
def test_first_tile_reload_after_the_pdl_wait_reads_through_l2():
    """With PREFETCH_KV a split program loads its first K/V tile before its PDL wait; the one
    holding the new token loads it again after. A plain load may hit the early load's stale lines
    in this SM's L1, so the reload is .cg: the prefetching kernel has more .cg loads (the reload's
    K and V) than the one without (the split merge's alone)."""
    plain, prefetch = (int(n) for n in compile_offline(_RELOAD).split())
    assert plain > 0 and prefetch > plain


@pytest.mark.skipif(not sass.available(), reason="this Triton ships no CUDA toolchain")
def test_weight_prefetch_goes_before_the_wait_or_after_the_kv_loads():
    """The next GEMVs' weights are asked into L2 (l2_prefetch.py) only when ranges are given, one
    bulk prefetch a range: at the start before the PDL wait, or at the end after this program's
    attention (its K/V loads have returned) and before the merge's atomic."""
    rows = [[int(n) for n in line.split()] for line in compile_offline(_L2).splitlines()]
    (first, wait, atom, none, some), (first_e, wait_e, atom_e, none_e, some_e) = rows
    assert first < wait and wait_e < first_e < atom_e
    assert none == none_e == 0 and some == some_e == 3
