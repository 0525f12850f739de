"""The fused split merge of paged decode attention (decode_attention.py, split_merge.py): the last
split program of a (sequence, kv head) merges, its counters re-armed for the next call; against
the torch reference, the unfused merge kernel and itself (the peeled first chunk). CPU under
Triton's interpreter, as test_attention_kernels.py."""

from __future__ import annotations

import pytest
import torch

from kipp_cuda.kernels import decode_attention as dec
from kipp_cuda.kernels import split_merge as sm
from tests.cuda.kernel_testing import DEV, cases, poisoned_empty, skip_unless_runnable
from tests.cuda.test_attention_kernels import _decode, assert_close

skip_unless_runnable()


def _fused_case(dtype, G, q8, ctx=(300, 1, 0, 64, 129, 257), seed=0):
    return _decode(dtype, G, q8=q8, hkv=2, d=64, page=16, ctx=list(ctx), seed=seed)


def _decode_op(p, q, scale, num_splits, **kw):
    with poisoned_empty():  # out, mid_o and mid_lse are born NaN on every call
        return dec._paged_decode_attention_op(
            q,
            *p.cache_args(),
            p.block_tables,
            p.context_lens,
            scale,
            *p.scales(),
            max_context_len=4096,
            num_splits=num_splits,
            **kw,
        )


def _counters_zeroed():
    held = sm._COUNTERS.get(torch.device(DEV), [])
    return all(not c.any() for c in held)


@pytest.mark.parametrize(
    "skip, G, dtype_chunk, q8",
    cases(  # 32 on a GPU, 8 interpreted (each ~8 s): every pair of values
        skip={"all-count": False, "skip-empty": True},
        G=[2, 3, 4, 8],
        dtype_chunk={"f32-chunk1": (torch.float32, 1), "bf16": (torch.bfloat16, None)},
        q8={"plain": False, "q8": True},
    ),
)
def test_decode_fused_merge_repeated_calls(skip, G, dtype_chunk, q8, short_splits, monkeypatch):
    # A batch of ragged contexts over 7 splits of one tile: contexts 0 and 1 leave 6 or 7 splits
    # empty, 300 fills 5 of them. Two calls into the same counters: the second would leave `out`
    # NaN (no program would count to the last) if the first had not re-armed them. skip: the
    # empty splits leave at once and only the live ones count in (SKIP_EMPTY_SPLITS).
    dtype, merge_chunk = dtype_chunk
    if merge_chunk is not None:  # one split a step of the fused merge: its loop runs 5 times
        monkeypatch.setattr(dec, "MERGE_CHUNK", merge_chunk)
    monkeypatch.setattr(dec, "FUSED_MERGE", True)
    monkeypatch.setattr(dec, "SKIP_EMPTY_SPLITS", skip)
    p, q, scale, ref = _fused_case(dtype, G, q8, seed=40 + G)
    first = _decode_op(p, q, scale, 7)
    assert_close(first, ref, dtype)
    assert _counters_zeroed()
    second = _decode_op(p, q, scale, 7)
    assert torch.equal(first, second)  # deterministic: the merge runs in split order
    assert _counters_zeroed()
    # As a CUDA-graph replay would: same split count, new contexts (all shorter, one now empty).
    p.context_lens.copy_(torch.tensor([257, 0, 0, 63, 64, 130], dtype=torch.int32))
    p.ctx_lens = p.context_lens.tolist()
    ref = dec.paged_decode_attention_ref(
        q, *p.cache_args(), p.block_tables, p.context_lens, scale, *p.scales()
    )
    assert_close(_decode_op(p, q, scale, 7), ref, dtype)
    assert _counters_zeroed()


# every pair of (G, dtype, cache) values once: 4 of the 8 combinations (each ~14 s interpreted)
@pytest.mark.parametrize(
    "G, dtype, q8",
    [
        (2, torch.float32, False),
        (2, torch.bfloat16, True),
        (8, torch.float32, True),
        (8, torch.bfloat16, False),
    ],
    ids=["2-f32-plain", "2-bf16-q8", "8-f32-q8", "8-bf16-plain"],
)
def test_decode_fused_and_unfused_merge_agree(dtype, G, q8, monkeypatch):
    # The default split length (MIN_TILES_PER_SPLIT tiles) over 4 and 16 splits (5 of them
    # non-empty at most), fused and unfused merge, the first tile loaded before the PDL wait or
    # in the loop: all within rounding of each other. The partials are fp32, but the two merges
    # round differently in their last bit, which can move a bf16 output by one ulp (1 of 6,144
    # elements on an H200); so one rounding of the output dtype is allowed.
    p, q, scale, ref = _fused_case(dtype, G, q8, ctx=(600, 129, 0, 1, 300, 256), seed=50 + G)
    ulp = 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps
    for num_splits in (4, 16):
        outs = []
        for prefetch, fused in ((True, True), (True, False), (False, True)):
            monkeypatch.setattr(dec, "PREFETCH_KV", prefetch)
            outs.append(_decode_op(p, q, scale, num_splits, fused_merge=fused))
            assert_close(outs[-1], ref, dtype)
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], atol=1e-6, rtol=ulp)
    assert _counters_zeroed()


@pytest.mark.parametrize("merge_chunk", [1, 2, None], ids=["chunk1", "chunk2", "default"])
def test_decode_fused_merge_peel_is_the_same_sums(merge_chunk, short_splits, monkeypatch):
    # MERGE_PEEL issues the first chunk's loads with the lse max's; the sums and their order are
    # the loop's, so the outputs are bit-equal (chunks of 1 and 2 splits: the loop runs after
    # the peeled chunk, up to 4 more times; the default chunk holds every split)
    if merge_chunk is not None:
        monkeypatch.setattr(dec, "MERGE_CHUNK", merge_chunk * 4 * 64)  # G = 4, D = 64
    p, q, scale, ref = _fused_case(torch.bfloat16, 4, False, seed=61)
    outs = []
    for peel in (True, False):
        monkeypatch.setattr(dec, "MERGE_PEEL", peel)
        outs.append(_decode_op(p, q, scale, 7, fused_merge=True))
    assert_close(outs[0], ref, torch.bfloat16)
    assert torch.equal(outs[0], outs[1])
    assert _counters_zeroed()


def test_decode_fused_merge_all_empty_and_counter_sizes():
    # Every context 0 (padded slots): each (sequence, kv head) merges 5 empty splits into zeros.
    p, q, scale, ref = _decode(torch.float32, 4, q8=False, ctx=[0, 0, 0], d=32, page=16)
    out = _decode_op(p, q, scale, 5, fused_merge=True)
    assert (out == 0).all() and _counters_zeroed()
    c = sm.split_counters(torch.device(DEV), 3 * 2)
    assert c.dtype == torch.int32 and c.numel() >= 6
    assert sm.split_counters(torch.device(DEV), 5) is c  # kept while big enough
    big = sm.split_counters(torch.device(DEV), c.numel() + 1)  # grows; the old one is kept
    assert big.numel() > c.numel() and sm._COUNTERS[torch.device(DEV)][-2] is c


# -- prefill ----------------------------------------------------------------------------------

# (q_len, cached prefix) per sequence: fresh prompts at block-boundary lengths, chunked prefill
# over a cached prefix, a single token, an empty q range, and speculative verification (q_len 2-8).
