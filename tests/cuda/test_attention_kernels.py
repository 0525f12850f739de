"""kv_write, paged decode and paged prefill attention: each Triton op against its torch reference,
and the references against a float64 attention written here from the dense K/V. Caches hold NaN
everywhere a sequence has no context (and tables point past the end at NaN blocks), so a kernel that
reads outside a context fails; outputs are born NaN (deterministic mode fills torch.empty), so one
that leaves an element unwritten fails too. On CPU the kernels run under TRITON_INTERPRET=1 at small
shapes; the tests marked gpu run Qwen3 shapes on a CUDA device."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kipp_core.quant import quantize_q8_0
from kipp_cuda.kernels import decode_attention as dec
from kipp_cuda.kernels import kv_write as kvw
from kipp_cuda.kernels import prefill_attention as pre
from tests.cuda.kernel_testing import (
    DEV,
    DTYPE_IDS,
    Paged,
    cases,
    naive_attention,
    poisoned_empty,
    skip_unless_runnable,
)

skip_unless_runnable()

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# The CPU interpreter rounds float32 -> bfloat16 toward zero (2 ulp rather than 1/2); on a GPU bf16
# and fp16 also carry the probabilities' rounding into the PV dot.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def assert_close(out, expect, dtype):
    assert torch.isfinite(out).all(), "an output element was left unwritten (or read poison)"
    torch.testing.assert_close(out.float().cpu(), expect.float().cpu(), **TOL[dtype])


# -- kv_write ---------------------------------------------------------------------------------


def _kv_write_case(dtype, q8, T=37, hkv=3, d=64, page=16, num_blocks=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    # k, v as strided views of one fused buffer, as a qkv projection gives them.
    kv = torch.randn(T, 2 * hkv + 1, d, generator=g).to(dtype)
    k, v = kv[:, :hkv], kv[:, hkv : 2 * hkv]
    k[0, 0, :32] = torch.tensor([2.5, -3.5] + [0.0] * 29 + [127.0])  # d = 1: exact ties round out
    k[1, 0, :32] = 0.0  # amax 0: d = 0, q = 0
    slots = torch.randperm(num_blocks * page, generator=g)[:T]
    slots[[3, 10, T - 1]] = -1  # padding tokens
    shape = (num_blocks, page, hkv, d)
    if q8:
        caches = [torch.full(shape, 7, dtype=torch.int8) for _ in range(2)]
        scales = [
            torch.full((*shape[:3], d // 32), float("nan"), dtype=torch.float16) for _ in range(2)
        ]
    else:
        caches = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(2)]
        scales = [None, None]
    return k, v, caches, scales, slots


@pytest.mark.parametrize("q8", [False, True], ids=["plain", "q8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_kv_write_matches_ref_and_numpy(dtype, q8):
    k, v, caches, scales, slots = _kv_write_case(dtype, q8)
    got = [c.to(DEV) for c in caches], [None if s is None else s.to(DEV) for s in scales]
    want = [c.clone() for c in caches], [None if s is None else s.clone() for s in scales]
    kvw._kv_write_op(k.to(DEV), v.to(DEV), *got[0], slots.to(DEV), *got[1])
    kvw.kv_write_ref(k, v, *want[0], slots, *want[1])
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        if a is not None:
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))  # NaNs too
    # Untouched slots keep their poison; written ones hold k (or its exact q8_0 from numpy).
    keep = slots >= 0
    flat_k = got[0][0].cpu().view(-1, *k.shape[1:])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    if q8:
        qs, dd = quantize_q8_0(k[keep].float().numpy())
        assert np.array_equal(flat_k[slots[keep]].numpy(), qs)
        flat_s = got[1][0].cpu().view(-1, *got[1][0].shape[2:])
        assert np.array_equal(flat_s[slots[keep]].numpy().view(np.uint16), dd.view(np.uint16))
        assert flat_s[untouched].isnan().all() and (flat_k[untouched] == 7).all()
        assert flat_k[slots[0], 0, :2].tolist() == [3, -4]
    else:
        assert torch.equal(flat_k[slots[keep]], k[keep])
        assert flat_k[untouched].isnan().all()


def test_kv_write_rejects_bad_layouts():
    k, v, caches, scales, slots = _kv_write_case(torch.float16, True)
    with pytest.raises(ValueError, match="k_scale"):
        kvw._kv_write_op(k, v, *caches, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        kvw._kv_write_op(k, v, *caches, slots.int(), *scales)
    with pytest.raises(ValueError, match="cache dtype"):
        kvw._kv_write_op(k, v, caches[0].bfloat16(), caches[1].bfloat16(), slots)


# -- decode -----------------------------------------------------------------------------------

DECODE_CTX = [1, 31, 32, 33, 64, 65, 130, 0]  # 0: a padded batch slot, which gives zeros


def _decode(dtype, G, q8, hkv=2, d=64, page=16, ctx=DECODE_CTX, seed=0):
    p = Paged(ctx, hkv, d, page, dtype, q8=q8, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(len(ctx), G * hkv, d, generator=g) * 2).to(dtype).to(DEV)
    scale = 1 / math.sqrt(d)
    ref = dec.paged_decode_attention_ref(
        q, *p.cache_args(), p.block_tables, p.context_lens, scale, *p.scales()
    )
    # The reference against float64 (its only error is the output's rounding).
    expect = naive_attention(q, p, [1] * len(ctx), scale)
    nz = [i for i, n in enumerate(ctx) if n]
    expect = expect[nz]
    assert_close(ref[nz], expect, dtype)
    assert (ref[[i for i, n in enumerate(ctx) if not n]] == 0).all()
    return p, q, scale, ref


@pytest.mark.parametrize("G, dtype", cases(1, G=[1, 2, 4, 5, 8], dtype=DTYPE_IDS))  # GPU: all 15
def test_paged_decode_attention(G, dtype, short_splits):
    p, q, scale, ref = _decode(dtype, G, q8=False, seed=G)
    for num_splits in (None, 3):  # the default (one split at these lengths) and flash-decoding
        with poisoned_empty():
            out = dec._paged_decode_attention_op(
                q,
                *p.cache_args(),
                p.block_tables,
                p.context_lens,
                scale,
                max_context_len=max(p.ctx_lens),
                num_splits=num_splits,
            )
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("G, dtype", cases(1, G=[1, 4, 5], dtype=DTYPE_IDS))  # GPU: all 9
def test_paged_decode_attention_q8(G, dtype, short_splits):
    p, q, scale, ref = _decode(dtype, G, q8=True, d=64, seed=10 + G)
    for num_splits in (1, 4):
        with poisoned_empty():
            out = dec._paged_decode_attention_op(
                q,
                *p.cache_args(),
                p.block_tables,
                p.context_lens,
                scale,
                *p.scales(),
                num_splits=num_splits,
            )
        assert_close(out, ref, dtype)


def test_decode_splits_are_host_ints_and_long_contexts_split():
    cpu = torch.device("cpu")
    assert dec.num_splits_for(1, 2, 16384, cpu) > 1
    assert dec.num_splits_for(1, 8, dec.BLOCK_N, cpu) == 1  # one tile: nothing to split
    assert dec.num_splits_for(64, 8, 1, cpu) == 1
    # A split count larger than the context allows collapses to what covers it.
    p, q, scale, ref = _decode(torch.float32, 2, q8=False, ctx=[65, 3], d=32, page=32)
    with poisoned_empty():
        out = dec._paged_decode_attention_op(
            q,
            *p.cache_args(),
            p.block_tables,
            p.context_lens,
            scale,
            max_context_len=65,
            num_splits=64,
        )
    assert_close(out, ref, torch.float32)


def test_decode_through_dispatch_and_head_dim_128():
    p, q, scale, ref = _decode(
        torch.float16, 4, q8=False, hkv=1, d=128, page=32, ctx=[33, 97], seed=3
    )
    out = dec.paged_decode_attention(q, *p.cache_args(), p.block_tables, p.context_lens, scale)
    assert_close(out, ref, torch.float16)


PREFILL_SEQS = [(33, 0), (1, 40), (5, 27), (0, 9), (64, 31), (3, 70)]


def _prefill(dtype, G, q8, seqs=PREFILL_SEQS, hkv=2, d=64, page=16, seed=0):
    q_lens = [lq for lq, _ in seqs]
    ctx = [lq + pre_len for lq, pre_len in seqs]
    p = Paged(ctx, hkv, d, page, dtype, q8=q8, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(sum(q_lens), G * hkv, d, generator=g) * 2).to(dtype).to(DEV)
    cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device=DEV)
    scale = 1 / math.sqrt(d)
    args = (q, *p.cache_args(), p.block_tables, cu, p.context_lens, scale, max(q_lens))
    ref = pre.paged_prefill_attention_ref(*args, *p.scales())
    expect = naive_attention(q, p, q_lens, scale)
    assert_close(ref, expect, dtype)
    return p, args, ref


@pytest.mark.parametrize("G, dtype", cases(1, G=[1, 2, 4, 5, 8], dtype=DTYPE_IDS))  # GPU: all 15
def test_paged_prefill_attention(G, dtype):
    p, args, ref = _prefill(dtype, G, q8=False, seed=G)
    with poisoned_empty():
        out = pre._paged_prefill_attention_op(*args)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("G", [2, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_paged_prefill_attention_q8(dtype, G):
    p, args, ref = _prefill(dtype, G, q8=True, seed=20 + G)
    with poisoned_empty():
        out = pre._paged_prefill_attention_op(*args, *p.scales())
    assert_close(out, ref, dtype)


@pytest.mark.parametrize(
    "dtype, G, q8",
    [
        (torch.float32, 1, False),
        (torch.float16, 5, True),
        (torch.bfloat16, 4, False),
        (torch.bfloat16, 8, True),
    ],
    ids=["f32-1", "f16-5-q8", "bf16-4", "bf16-8-q8"],
)
def test_paged_prefill_attention_split_kv(dtype, G, q8):
    # Short queries (verification) over longer contexts, the KV range split and merged; some
    # splits lie wholly above some rows' positions, or past a short context.
    seqs = [(4, 150), (1, 0), (8, 63), (2, 1)]
    p, args, ref = _prefill(dtype, G, q8=q8, seqs=seqs, seed=30 + G)
    for num_splits in (None, 8):
        with poisoned_empty():
            out = pre._paged_prefill_attention_op(*args, *p.scales(), num_splits=num_splits)
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("q_len", [1, 31, 32, 33, 65])
def test_prefill_block_boundaries_single_sequence(q_len):
    # Fresh prompt and the same tokens after a 31-token cached prefix, head_dim 128, pages of 32.
    for prefix in (0, 31):
        p, args, ref = _prefill(
            torch.float32,
            4,
            q8=False,
            seqs=[(q_len, prefix)],
            hkv=1,
            d=128,
            page=32,
            seed=q_len + prefix,
        )
        with poisoned_empty():
            out = pre._paged_prefill_attention_op(*args)
        assert_close(out, ref, torch.float32)


def test_prefill_short_queries_match_decode():
    # q_len 1 per sequence is decode: the two kernels agree.
    p, args, ref = _prefill(torch.float16, 4, q8=False, seqs=[(1, 40), (1, 0), (1, 64)], seed=5)
    out = pre.paged_prefill_attention(*args)
    q, kc, vc, bt, _, lens, scale, _ = args
    dout = dec.paged_decode_attention(q, kc, vc, bt, lens, scale)
    assert_close(out, ref, torch.float16)
    assert_close(dout, out, torch.float16)


def test_prefill_config_is_deterministic():
    cpu = torch.device("cpu")
    assert pre.prefill_num_splits(1, 4, cpu) > 1 and pre.prefill_num_splits(1, 17, cpu) == 1
    assert pre.prefill_config(16384, 4, torch.bfloat16)["BLOCK_M"] == 128
    small = pre.prefill_config(4, 4, torch.bfloat16)
    assert small["BLOCK_M"] == 16 and small["BLOCK_Q"] == 4
    assert pre.prefill_config(1, 5, torch.bfloat16)["BLOCK_Q"] == 3
