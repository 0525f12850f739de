"""The conformance gates on MLX's GPU path with every custom kernel required: float32 logits
against the oracle, bf16 NMSE, batched equals isolated, chunked, paged, prefix hit and the
quantized formats, on a model with Qwen3's head_dim (128) and GQA. tests/conformance runs the
same engine gates on every backend (on the GPU too, where MLX runs there); this file adds
KIPP_MLX_REQUIRE_KERNELS, bf16 and the real head shape. Skipped where MLX runs on the CPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kipp_core.checkpoint import Checkpoint
from kipp_core.llm import LLM
from kipp_mlx.kernels import ladder
from oracle.qwen3 import forward, load_weights
from tests.conformance.test_backend_gates import (
    GREEDY,
    assert_same,
    oracle_greedy,
    prompts,
    staggered,
)
from tests.conftest import nmse, rel_err, small_config
from tests.mlx.test_quant import oracle_quantized_at_load

pytestmark = pytest.mark.skipif(
    ladder.gpu_kind() is None,
    reason="the GPU gates need MLX on Metal or CUDA; this MLX runs on the CPU",
)

# Qwen3-0.6B's attention shape (16 q heads, 8 kv heads, head_dim 128) at a toy width
CFG = small_config(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
)


@pytest.fixture(autouse=True)
def required(monkeypatch):
    monkeypatch.setenv("KIPP_MLX_REQUIRE_KERNELS", "1")


@pytest.fixture(scope="module")
def path(make_checkpoint):
    return make_checkpoint(CFG, seed=21)


def llm(path, **kw):
    kw.setdefault("dtype", "float32")
    return LLM(str(path), backend="mlx", **kw)


def ids(n, seed):
    return prompts(1, seed=seed, lo=n, hi=n + 1)[0]


def test_float32_logits_match_oracle(path):
    p = [t % CFG.vocab_size for t in ids(300, 1)]
    assert rel_err(llm(path).logits(p), forward(load_weights(Checkpoint(path)), p)) <= 1e-5


def test_bf16_logits_nmse(path):
    p = [t % CFG.vocab_size for t in ids(300, 2)]
    got = llm(path, dtype="bfloat16").logits(p)
    assert nmse(got, forward(load_weights(Checkpoint(path)), p)) <= 1e-3


def _prompts(n, seed, lo=3, hi=90):
    return [[t % CFG.vocab_size for t in p] for p in prompts(n, seed=seed, lo=lo, hi=hi)]


def test_greedy_and_paged_equal_oracle(path):
    p = _prompts(1, 4, 70, 71)[0]
    want = oracle_greedy(path, p, GREEDY.max_tokens)
    for bs in (16, 32):
        assert llm(path, block_size=bs).generate([p], GREEDY)[0].token_ids == want


def test_batched_equals_isolated(path):
    m = llm(path, block_size=16, max_num_batched_tokens=64)
    ps = _prompts(8, 5)
    alone = [m.generate([p], GREEDY)[0] for p in ps]
    done = staggered(m, ps, GREEDY)
    for i, a in enumerate(alone):
        assert_same(a, done[i])


def test_chunked_equals_unchunked(path):
    ps = _prompts(2, 7, 150, 200)
    for x, y in zip(
        llm(path).generate(ps, GREEDY), llm(path, max_num_batched_tokens=33).generate(ps, GREEDY)
    ):
        assert_same(x, y)


def test_prefix_hit_equals_cold(path):
    base = _prompts(1, 9, 100, 101)[0]
    warm = llm(path, block_size=16)
    warm.generate([base + [1, 2]], GREEDY)
    hot = warm.generate([base + [3, 4, 5]], GREEDY)[0]
    assert hot.metrics.num_cached_tokens == 96
    cold = llm(path, enable_prefix_caching=False).generate([base + [3, 4, 5]], GREEDY)[0]
    assert_same(hot, cold)


@pytest.mark.parametrize("scheme", ["affine4", "affine8", "q8_0"])
def test_quantized_at_load_matches_oracle(path, scheme):
    p = [t % CFG.vocab_size for t in ids(200, 11)]
    got = llm(path, quant=scheme).logits(p)
    assert rel_err(got, forward(oracle_quantized_at_load(path, scheme), p)) <= 1e-5


def test_steps_write_the_pool_in_place(path, monkeypatch):
    """Prefill and decode steps leave each layer's pool array where it was, their new slots
    written: handles taken before a generation read its K/V after it (MLX's scatter into a pool
    the previous step still holds would have copied it, leaving the handles behind)."""
    m = llm(path, dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory="64MiB")
    kv = m.engine.backend.kv
    kv.reserve(kv.num_blocks - 1)  # no growth: the arrays stay the cache's own
    m.generate(_prompts(1, 13, 40, 41), GREEDY)
    before = list(kv.kv)
    m.generate(_prompts(2, 14, 40, 60), GREEDY)
    for g, w in zip(before, kv.kv):
        np.testing.assert_array_equal(
            np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32))
        )
