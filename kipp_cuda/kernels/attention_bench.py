"""Benchmark cases of the paged attention kernels (decode_attention.py, prefill_attention.py) at
the Qwen3-8B shape (Hq 32, Hkv 8, D 128, bf16, 32-token pages), over caches whose pages are
shuffled, as a long-running server's would be. Bytes count the KV read; flops the scores and PV."""

from __future__ import annotations

import math

import torch
import triton

from kipp_cuda.kernels.decode_attention import (
    _paged_decode_attention_op,
    paged_decode_attention_ref,
)
from kipp_cuda.kernels.prefill_attention import (
    _paged_prefill_attention_op,
    paged_prefill_attention_ref,
)

HQ, HKV, D, PAGE = 32, 8, 128, 32


def bench_specs() -> list[dict]:
    decode = [
        ("decode b1 ctx16k", [16384], False),
        ("decode b64 ctx2k", [2048] * 64, False),
        ("decode b256 ctx1k", [1024] * 256, False),
        ("decode b64 ctx2k q8", [2048] * 64, True),
    ]
    prefill = [
        ("prefill 1x2k", [2048], [2048]),
        ("prefill 1x16k", [16384], [16384]),
        ("prefill 8x2k", [2048] * 8, [2048] * 8),
        ("chunk 2k after 14k", [2048], [16384]),
        ("verify 64x q4 ctx2k", [4] * 64, [2048] * 64),
        ("verify 1x q5 ctx16k", [5], [16384]),
    ]
    return [_decode_case(*c) for c in decode] + [_prefill_case(*c) for c in prefill]


def _paged_cache(ctxs: list[int], q8: bool) -> tuple[tuple, torch.Tensor, int]:
    """((k, v, k_scale, v_scale), block_tables, KV bytes read) for sequences of lengths ctxs."""
    dev, B = "cuda", len(ctxs)
    blocks_per_seq = triton.cdiv(max(ctxs), PAGE)
    shape = (B * blocks_per_seq, PAGE, HKV, D)
    if q8:
        kc = torch.randint(-127, 128, shape, dtype=torch.int8, device=dev)
        vc = torch.randint(-127, 128, shape, dtype=torch.int8, device=dev)
        ks = torch.rand(*shape[:3], D // 32, device=dev).to(torch.float16) * 0.01
        vs = torch.rand_like(ks) * 0.01
    else:
        kc = torch.randn(shape, dtype=torch.bfloat16, device=dev)
        vc = torch.randn_like(kc)
        ks = vs = None
    bt = torch.randperm(shape[0], device=dev).to(torch.int32).view(B, blocks_per_seq)
    per_token = HKV * (D * kc.element_size() + (D // 32 * 2 if q8 else 0))
    return (kc, vc, ks, vs), bt, 2 * sum(ctxs) * per_token


def _decode_case(name: str, ctxs: list[int], q8: bool) -> dict:
    (kc, vc, ks, vs), bt, kv_bytes = _paged_cache(ctxs, q8)
    B = len(ctxs)
    lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda")
    args = (q, kc, vc, bt, lens, 1 / math.sqrt(D), ks, vs, max(ctxs))
    return {
        "name": name,
        "fn": lambda: _paged_decode_attention_op(*args),
        "ref": lambda: paged_decode_attention_ref(*args),
        "bytes": kv_bytes + 2 * q.numel() * 2 + bt.numel() * 4,
        "flops": 4 * HQ * D * sum(ctxs),
    }


def _prefill_case(name: str, q_lens: list[int], ctxs: list[int]) -> dict:
    (kc, vc, _, _), bt, kv_bytes = _paged_cache(ctxs, False)
    lens = torch.tensor(ctxs, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), HQ, D, dtype=torch.bfloat16, device="cuda")
    args = (q, kc, vc, bt, cu.cuda(), lens, 1 / math.sqrt(D), max(q_lens))
    # Causal: each query sees the cached prefix and the new tokens up to itself, counted once.
    visible = sum(lq * (n - lq) + lq * (lq + 1) // 2 for lq, n in zip(q_lens, ctxs))
    return {
        "name": name,
        "fn": lambda: _paged_prefill_attention_op(*args),
        "ref": lambda: paged_prefill_attention_ref(*args),
        "bytes": kv_bytes + 2 * q.numel() * 2,
        "flops": 4 * D * HQ * visible,
    }
