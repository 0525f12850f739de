"""The paged KV cache: placement invariance, growth, and the opt-in q8_0 cache (its stored values
against kipp_core.quant's reference, its error against the float cache)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kipp_core.llm import LLM
from kipp_core.quant import quantize_q8_0
from kipp_core.sampling import SamplingParams
from kipp_mlx.kv_cache import PagedKVCache
from tests.conftest import logprob_atol, nmse, small_config
from tests.mlx.conftest import make_backend, random_ids, run_logits

CFG = small_config(vocab_size=512, num_attention_heads=8, num_key_value_heads=2)
IDS = random_ids(41, 512, seed=20)


@pytest.fixture(scope="module")
def path(make_checkpoint):
    return make_checkpoint(CFG, seed=21)


@pytest.mark.parametrize("kv_quant", [None, "q8_0"])
def test_same_prompt_on_other_blocks_gives_the_same_logits(path, kv_quant):
    be = make_backend(path, block_size=4, kv_quant=kv_quant)
    a = run_logits(be, IDS, table=range(11), chunks=(16,))
    b = run_logits(be, IDS, table=range(40, 29, -1), chunks=(16,), seq_id=2)
    c = run_logits(be, IDS, table=np.random.default_rng(0).permutation(60)[:11], chunks=(16,))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)


def test_q8_0_cache_stores_the_reference_quantization(path):
    """Layer 0's K/V do not depend on the cache, so the q8_0 pool must hold exactly
    kipp_core.quant.quantize_q8_0 of what the float pool holds."""
    dense = make_backend(path, block_size=8)
    q8 = make_backend(path, block_size=8, kv_quant="q8_0")
    table = [5, 2, 7, 0, 9, 3]
    run_logits(dense, IDS, table)
    run_logits(q8, IDS, table)
    slots = mx.array([table[p // 8] * 8 + p % 8 for p in range(len(IDS))])
    for j, pools_q in enumerate((q8.kv.k, q8.kv.v)):  # the dense pool: [slots, 2 (K, V), ...]
        want_qs, want_d = quantize_q8_0(np.array(dense.kv.kv[0][slots][:, j]))
        qs, d = pools_q[0]
        np.testing.assert_array_equal(np.array(qs[slots]), want_qs)
        np.testing.assert_array_equal(np.array(d[slots]), want_d)


def test_q8_0_cache_error_against_float_cache(path):
    dense = run_logits(make_backend(path, block_size=8), IDS, chunks=(9, 9))
    q8 = run_logits(make_backend(path, block_size=8, kv_quant="q8_0"), IDS, chunks=(9, 9))
    assert 0 < nmse(q8, dense) <= 3e-4  # measured 6e-5 on these weights


def test_q8_0_cache_through_the_engine(path):
    """Prefix hits reuse quantized blocks: the result equals a cold run."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    warm = LLM(str(path), backend="mlx", dtype="float32", block_size=8, kv_quant="q8_0")
    warm.generate([IDS[:33]], sp)
    hot = warm.generate([IDS[:33] + [7, 8]], sp)[0]
    assert hot.metrics.num_cached_tokens == 32
    cold = LLM(
        str(path),
        backend="mlx",
        dtype="float32",
        block_size=8,
        kv_quant="q8_0",
        enable_prefix_caching=False,
    ).generate([IDS[:33] + [7, 8]], sp)[0]
    assert hot.token_ids == cold.token_ids
    # the same quantized blocks, attended over in another split (32 cached + 3 new rows)
    tol = logprob_atol(16.0, max(CFG.intermediate_size, CFG.hidden_size) + 41, CFG.vocab_size)
    np.testing.assert_allclose(
        [x.logprob for x in hot.outputs[0].logprobs],
        [x.logprob for x in cold.outputs[0].logprobs],
        atol=tol,
    )


def test_pool_grows_and_keeps_what_it_holds():
    kv = PagedKVCache(2, 100, 4, 2, 32, mx.float32)
    assert kv.capacity == 16
    k = mx.array(np.random.default_rng(0).standard_normal((3, 2, 32)).astype(np.float32))
    slots = mx.array([1, 6, 63])
    kv.write(1, mx.stack([k, k * 2], axis=1), slots)
    kv.reserve(70)
    assert kv.capacity == 71 and kv.kv[1].shape[0] == 71 * 4
    got_k, got_v = kv.read(1, slots)
    assert mx.array_equal(got_k, k).item() and mx.array_equal(got_v, k * 2).item()
    with pytest.raises(ValueError, match="block id 100"):
        kv.reserve(100)


def test_q8_0_cache_needs_head_dim_of_32s(make_checkpoint):
    path = make_checkpoint(small_config(vocab_size=512, head_dim=16))
    with pytest.raises(ValueError, match="head_dim divisible by 32"):
        make_backend(path, kv_quant="q8_0")
