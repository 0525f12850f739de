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
            v_scale_ptr="*bf16", block_tables_ptr="*i32", context_lens_ptr="*i32")
sig = {n: PTRS.get(n, "i32" if n.startswith("stride") or n == "num_splits" else "constexpr")
       for n in K.arg_names}
sig["qk_scale"] = "fp32"
for prefetch in (False, True):
    consts = dict(G=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_N=64, PAGE_SIZE=32, IS_Q8=False,
                  ONE_SPLIT=False, MIN_TILES=1, DOT_DTYPE=tl.bfloat16, PRECISION="tf32",
                  FUSED_MERGE=True, MERGE_H=4, BLOCK_S=64, CHUNK_S=32, MERGE_PEEL=True, PDL=True,
                  PREFETCH=prefetch)
    src = ASTSource(fn=K, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=sass.TARGET, options=dict(num_warps=4)).asm["ptx"]
    print(sum("ld.global" in line and ".cg" in line for line in ptx.splitlines()))
"""


@pytest.mark.skipif(not sass.available(), reason="this Triton ships no CUDA toolchain")
def test_first_tile_reload_after_the_pdl_wait_reads_through_l2():
    """With PREFETCH_KV a split program loads its first K/V tile before its PDL wait; the one
    holding the new token loads it again after. A plain load may hit the early load's stale lines
    in this SM's L1, so the reload is .cg: the prefetching kernel has more .cg loads (the reload's
    K and V) than the one without (the split merge's alone)."""
    plain, prefetch = (int(n) for n in compile_offline(_COMPILE).split())
    assert plain > 0 and prefetch > plain
