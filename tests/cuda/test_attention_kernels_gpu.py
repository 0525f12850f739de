"""The attention kernels at Qwen3 shapes on a GPU (skipped without one)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kipp_cuda.kernels import attention_bench
from kipp_cuda.kernels import decode_attention as dec
from kipp_cuda.kernels import kv_write as kvw
from kipp_cuda.kernels import prefill_attention as pre
from kipp_cuda.kernels import split_merge as sm
from tests.cuda.kernel_testing import HAS_CUDA, poisoned_empty
from tests.cuda.test_attention_kernels import assert_close

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (Qwen3 shapes)")

# -- GPU: Qwen3 shapes ------------------------------------------------------------------------


def _gpu_paged(ctx_lens, hkv, dtype=torch.bfloat16, q8=False, seed=0):
    # Built on the GPU directly (the CPU Paged builder is slow at 16k): no dense copies kept.
    g = torch.Generator(device="cuda").manual_seed(seed)
    page, d = 32, 128
    need = [math.ceil(n / page) for n in ctx_lens]
    num_blocks = sum(need) + 1
    shape = (num_blocks, page, hkv, d)
    if q8:
        kc = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8, device="cuda")
        vc = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8, device="cuda")
        ks = (torch.rand(*shape[:3], d // 32, generator=g, device="cuda") / 64).half()
        vs = (torch.rand(*shape[:3], d // 32, generator=g, device="cuda") / 64).half()
    else:
        kc = torch.randn(shape, generator=g, device="cuda").to(dtype)
        vc = torch.randn(shape, generator=g, device="cuda").to(dtype)
        ks = vs = None
    perm = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    bt = torch.full((len(ctx_lens), max(need)), int(perm[-1]), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[used : used + n]
        used += n
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    return kc, vc, ks, vs, bt, lens


@gpu
@pytest.mark.parametrize("hq", [16, 32, 40, 64])
@pytest.mark.parametrize("case", ["b1-16k", "b1-128k", "b64-2k", "b256-1k", "ragged"])
def test_gpu_decode_qwen3_shapes(case, hq):
    ctx = {
        "b1-16k": [16384],
        "b1-128k": [131072],  # YaRN's 131,072 (4B-32B)
        "b64-2k": [2048] * 64,
        "b256-1k": [1000] * 256,
        "ragged": [1, 31, 32, 33, 4095, 9000, 0, 513],
    }[case]
    for q8 in (False, True):
        kc, vc, ks, vs, bt, lens = _gpu_paged(ctx, 8, q8=q8, seed=hq)
        q = torch.randn(len(ctx), hq, 128, device="cuda", dtype=torch.bfloat16)
        ref = dec.paged_decode_attention_ref(q, kc, vc, bt, lens, 128**-0.5, ks, vs)
        for fused in (True, False):
            with poisoned_empty():
                out = dec._paged_decode_attention_op(
                    q,
                    kc,
                    vc,
                    bt,
                    lens,
                    128**-0.5,
                    ks,
                    vs,
                    max_context_len=max(ctx),
                    fused_merge=fused,
                )
            assert_close(out, ref, torch.bfloat16)


@gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_gpu_decode_cuda_graph_replay(fused):
    # One graph per (batch, max_context_len); replays see new lengths, tables and queries.
    B, max_ctx = 8, 4096
    kc, vc, _, _, bt, lens = _gpu_paged([max_ctx] * B, 8, seed=1)
    q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
    kw = dict(max_context_len=max_ctx, fused_merge=fused)
    out = dec._paged_decode_attention_op(q, kc, vc, bt, lens, 0.088, **kw)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dec._paged_decode_attention_op(q, kc, vc, bt, lens, 0.088, **kw)
    for new_lens in ([4096, 1, 0, 33, 2048, 31, 4000, 64], [5] * B, [0] * B):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        bt.copy_(bt.flip(0))
        q.normal_()
        graph.replay()
        ref = dec.paged_decode_attention_ref(q, kc, vc, bt, lens, 0.088)
        assert_close(out, ref, torch.bfloat16)
        assert all(not c.any() for c in sm._COUNTERS.get(q.device, []))  # all re-armed


@gpu
@pytest.mark.parametrize("ctx", [[2048], [2048, 1, 0, 40960, 777]], ids=["b1-2k", "ragged"])
def test_gpu_decode_fused_merge_deterministic(ctx):
    # Qwen3-0.6B heads in a graph made for max_model_len 40960: at 2k, 16 of 33 splits hold
    # context. 50 graph replays of the fused merge give the same bits each time, whichever split
    # program arrives last, and agree with the separate merge kernel.
    kc, vc, _, _, bt, lens = _gpu_paged(ctx, 8, seed=7)
    q = torch.randn(len(ctx), 16, 128, device="cuda", dtype=torch.bfloat16)
    kw = dict(max_context_len=40960)
    unfused = dec._paged_decode_attention_op(q, kc, vc, bt, lens, 0.088, fused_merge=False, **kw)
    out = dec._paged_decode_attention_op(q, kc, vc, bt, lens, 0.088, fused_merge=True, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dec._paged_decode_attention_op(q, kc, vc, bt, lens, 0.088, fused_merge=True, **kw)
    outs = []
    for _ in range(50):
        out.fill_(float("nan"))
        graph.replay()
        outs.append(out.clone())
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert_close(
        outs[0], dec.paged_decode_attention_ref(q, kc, vc, bt, lens, 0.088), torch.bfloat16
    )
    torch.testing.assert_close(outs[0], unfused, atol=1e-2, rtol=1e-2)
    assert all(not c.any() for c in sm._COUNTERS.get(q.device, []))


@gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_gpu_decode_sees_the_token_stored_just_before(graph):
    # The decode kernel loads its first K/V tile before its PDL wait. The new token's slot is
    # poisoned with NaN before each step and written by the KV-write kernel launched just before
    # the attention: a program that kept the early (stale) load of that slot would return NaN.
    # Contexts put the new token first in a split, last in a tile, alone in a tile, or at 1.
    from kipp_cuda.kernels.qk_norm_rope import qk_norm_rope_kv_write, rope_cos_sin_cache

    ctx = [2100, 1, 64, 65, 129, 2048, 4097]
    hq, hkv, d = 32, 8, 128
    kc, vc, _, _, bt, lens = _gpu_paged(ctx, hkv, seed=11)
    B = len(ctx)
    pos = lens.long() - 1
    slots = bt.long().gather(1, (pos // 32)[:, None])[:, 0] * 32 + pos % 32
    cos_sin = rope_cos_sin_cache(8192, d, 1e6, "cuda")
    qn = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    kn = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    qkv = torch.randn(B, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)

    def step():
        q = qk_norm_rope_kv_write(qkv, qn, kn, pos, cos_sin, hq, hkv, d, 1e-6, slots, kc, vc)
        return dec.paged_decode_attention(q, kc, vc, bt, lens, d**-0.5, max_context_len=4097)

    def poison():
        kc.view(-1, hkv, d)[slots] = float("nan")
        vc.view(-1, hkv, d)[slots] = float("nan")

    out = step()  # warm-up (and the split counters, before capture)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
    for _ in range(20):
        poison()
        if graph:
            g.replay()
        else:
            out = step()
        torch.cuda.synchronize()
        q = qk_norm_rope_kv_write(qkv, qn, kn, pos, cos_sin, hq, hkv, d, 1e-6, slots, kc, vc)
        assert not out.isnan().any()
        assert_close(
            out, dec.paged_decode_attention_ref(q, kc, vc, bt, lens, d**-0.5), torch.bfloat16
        )


@gpu
@pytest.mark.parametrize("hq", [16, 32, 40, 64])
@pytest.mark.parametrize(
    "case",
    [
        "1x4k",
        "chunk-1k-after-7k",
        "chunk-8k-after-120k",
        "mixed",
        "verify-q4",
        "verify-b1-16k",
        "verify-b1-128k",
    ],
)
def test_gpu_prefill_qwen3_shapes(case, hq):
    seqs = {
        "1x4k": [(4096, 0)],
        "chunk-1k-after-7k": [(1024, 7000)],
        "chunk-8k-after-120k": [(8192, 131072 - 8192)],  # the last chunk of a 131,072 prefill
        "mixed": [(513, 0), (1, 2000), (64, 64), (777, 31)],
        "verify-q4": [(4, 1000)] * 32,
        "verify-b1-16k": [(5, 16379)],
        "verify-b1-128k": [(5, 131067)],
    }[case]
    q_lens = [lq for lq, _ in seqs]
    ctx = [lq + p for lq, p in seqs]
    for q8 in (False, True):
        kc, vc, ks, vs, bt, lens = _gpu_paged(ctx, 8, q8=q8, seed=hq)
        q = torch.randn(sum(q_lens), hq, 128, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32, device="cuda")
        args = (q, kc, vc, bt, cu, lens, 128**-0.5, max(q_lens), ks, vs)
        with poisoned_empty():
            out = pre._paged_prefill_attention_op(*args)
        assert_close(out, pre.paged_prefill_attention_ref(*args), torch.bfloat16)


@gpu
def test_gpu_attention_at_128k_holds_no_context_sized_buffer():
    """Flash tiles: what a call allocates is its output and the splits' partials (at most
    MAX_SPLITS of them a row), never scores of the context (an 8B-shape [32, 131072] fp32 row
    of scores a query alone is 16 MiB, a 1,024-query chunk's 16 GiB)."""
    n, hq = 131072, 32
    kc, vc, _, _, bt, lens = _gpu_paged([n], 8, seed=5)
    q = torch.randn(1, hq, 128, device="cuda", dtype=torch.bfloat16)
    chunk = torch.randn(1024, hq, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 1024], dtype=torch.int32, device="cuda")
    calls = {
        "decode": lambda: dec._paged_decode_attention_op(q, kc, vc, bt, lens, 0.088, None, None, n),
        "prefill": lambda: pre._paged_prefill_attention_op(
            chunk, kc, vc, bt, cu, lens, 0.088, 1024
        ),
    }
    for name, call in calls.items():
        call()  # compiled, split counters allocated
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = call()
        torch.cuda.synchronize()
        grew = torch.cuda.max_memory_allocated() - base
        partials = out.shape[0] * hq * dec.MAX_SPLITS * (128 + 1) * 4
        assert grew <= out.numel() * out.element_size() + partials + 2**20, (name, grew)


@gpu
def test_gpu_prefill_16k_and_kv_write():
    T, hkv = 16384, 8
    kc, vc, _, _, bt, lens = _gpu_paged([T], hkv, seed=2)
    k = torch.randn(T, hkv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = (bt[0].long()[:, None] * 32 + torch.arange(32, device="cuda")).flatten()[:T]
    kvw._kv_write_op(k, v, kc, vc, slots)
    assert torch.equal(kc.view(-1, hkv, 128)[slots], k)
    q = torch.randn(T, 32, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    args = (q, kc, vc, bt, cu, lens, 128**-0.5, T)
    with poisoned_empty():
        out = pre._paged_prefill_attention_op(*args)
    assert_close(out, pre.paged_prefill_attention_ref(*args), torch.bfloat16)


@gpu
def test_gpu_attention_bench_cases_match_their_references():
    # `kipp bench --kernels` times these (kernels.bench finds them by bench_specs: kv_write's,
    # and the attention kernels' in attention_bench.py, not in the kernel modules): each
    # attention case equals its torch reference, and kv_write's cases (which write caches) run.
    from kipp_cuda.kernels.bench import spec_modules

    assert {attention_bench, kvw} <= set(spec_modules())
    specs = attention_bench.bench_specs()
    assert len(specs) == 10 and all(s["bytes"] > 0 and s["flops"] > 0 for s in specs)
    for spec in specs:
        assert_close(spec["fn"](), spec["ref"](), torch.bfloat16)
    for spec in kvw.bench_specs():
        spec["fn"]()
        assert spec["bytes"] > 0
    torch.cuda.synchronize()
