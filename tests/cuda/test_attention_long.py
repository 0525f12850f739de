"""The attention references at long context (the CPU path of the cuda backend): chunked over
queries and cached positions (kernels/attention_ref.py), they equal a float64 softmax over the
dense K/V, and at 131,072 cached positions they hold memory of a chunk, not of the context."""

from __future__ import annotations

import pytest
import torch

from kipp_cuda.kernels import attention_ref as ar
from kipp_cuda.kernels import decode_attention as dec
from kipp_cuda.kernels import prefill_attention as pre
from tests.cuda.kernel_testing import Paged, naive_attention, randn

HQ, HKV, D, PAGE = 8, 2, 64, 32
# fp32 scores and sums over a few hundred positions: a few ulp of the output's scale
TOL32 = 1e-5


def _decode(p: Paged, q):
    return dec.paged_decode_attention_ref(q, *p.cache_args(), p.block_tables, p.context_lens, 0.125)


def _prefill(p: Paged, q, q_lens):
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, *p.cache_args(), p.block_tables, cu, p.context_lens, 0.125, max(q_lens))
    return pre.paged_prefill_attention_ref(*args)


def test_chunked_refs_equal_one_softmax(monkeypatch):
    monkeypatch.setattr(ar, "KV_CHUNK", 16)  # many chunks and query slices at small shapes
    monkeypatch.setattr(ar, "SCORE_ELEMS", 16 * HQ * 3)
    p = Paged([1, 37, 200], HKV, D, PAGE, torch.float32, seed=3, device="cpu")
    q = randn(3, HQ, D, seed=4).cpu()
    got = _decode(p, q)
    assert torch.allclose(got.double(), naive_attention(q, p, [1, 1, 1], 0.125), atol=TOL32)
    q_lens = [1, 20, 57]
    q = randn(sum(q_lens), HQ, D, seed=5).cpu()
    got = _prefill(p, q, q_lens)
    assert torch.allclose(got.double(), naive_attention(q, p, q_lens, 0.125), atol=TOL32)


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmHWM"))


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_refs_at_131k_context_hold_a_chunk_of_memory(kind):
    n = 131072
    p = Paged([n], HKV, D, PAGE, torch.bfloat16, seed=7, device="cpu")
    q_lens = [1] if kind == "decode" else [16]  # the last chunk of a chunked prefill
    q = randn(sum(q_lens), HQ, D, dtype=torch.bfloat16, seed=8).cpu()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pytest.skip("this kernel does not reset the peak RSS")
    before = _peak_kib()
    got = _decode(p, q) if kind == "decode" else _prefill(p, q, q_lens)
    grew = (_peak_kib() - before) / 1024
    # a chunk's K and V in fp32 (2 MiB each here) and its scores; the whole context in fp32,
    # repeated over the 4 query heads a kv head has, was 256 MiB a K
    assert grew < 64, f"the reference grew the peak RSS by {grew:.0f} MiB"
    want = naive_attention(q, p, q_lens, 0.125)
    # one bf16 rounding of each output (2^-9 of it) over fp32 sums of 131,072 terms
    assert torch.allclose(got.double(), want, atol=2**-8 * want.abs().max().item() + 1e-6)
