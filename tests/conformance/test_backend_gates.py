"""The engine gates on every backend: logits against the oracle, greedy tokens, batched equals
isolated, chunked equals unchunked, paged equals contiguous, prefix hit equals cold, preemption,
and no leaked blocks."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.checkpoint import Checkpoint
from kipp_core.sampling import SamplingParams
from oracle.qwen3 import KVCache, forward, load_weights
from tests.conftest import nmse, rel_err, small_config

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def prompts(n, seed=0, lo=3, hi=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 151000, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def oracle_greedy(path, prompt, n):
    w = load_weights(Checkpoint(path))
    cache = KVCache(w.config.num_hidden_layers)
    logits = forward(w, prompt, 0, cache)
    toks = []
    for _ in range(n):
        toks.append(int(np.argmax(logits[-1])))
        logits = forward(w, [toks[-1]], cache.length, cache)
    return toks


def assert_same(a, b, tol=1e-4):
    assert a.token_ids == b.token_ids
    la = [x.logprob for x in a.outputs[0].logprobs]
    lb = [x.logprob for x in b.outputs[0].logprobs]
    np.testing.assert_allclose(la, lb, atol=tol)


def test_float32_logits_match_oracle(make_llm, tiny_path):
    llm = make_llm()
    p = prompts(1, seed=1, lo=40, hi=41)[0]
    ref = forward(load_weights(Checkpoint(tiny_path)), p)
    assert rel_err(llm.logits(p), ref) <= 1e-5


GQA_SHAPES = [
    small_config(
        vocab_size=512,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    small_config(
        vocab_size=512,
        hidden_size=80,
        num_attention_heads=10,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
    ),
]


@pytest.mark.parametrize("cfg", GQA_SHAPES, ids=["gqa8-untied", "gqa5"])
def test_float32_logits_match_oracle_shapes(make_llm, make_checkpoint, cfg):
    path = make_checkpoint(cfg, seed=21)
    llm = make_llm(path, max_num_batched_tokens=16)  # chunked: prefill over a cached prefix
    p = prompts(1, seed=2, lo=50, hi=51)[0]
    p = [t % 512 for t in p]
    ref = forward(load_weights(Checkpoint(path)), p)
    assert rel_err(llm.logits(p), ref) <= 1e-5


def test_bf16_logits_nmse(make_llm, tiny_path, backend):
    if backend == "oracle":
        pytest.skip("the oracle computes in float32/float64 only")
    llm = make_llm(dtype="bfloat16")
    p = prompts(1, seed=3, lo=40, hi=41)[0]
    ref = forward(load_weights(Checkpoint(tiny_path)), p)
    assert nmse(llm.logits(p), ref) <= 1e-3


def test_greedy_tokens_equal_oracle(make_llm, tiny_path):
    p = prompts(1, seed=4)[0]
    out = make_llm(block_size=4).generate([p], GREEDY)[0]
    assert out.token_ids == oracle_greedy(tiny_path, p, GREEDY.max_tokens)


def staggered(llm, ps, params, seed=6) -> dict:
    """Request i (prompt ps[i]) arrives at a random step in 0..7 of one engine; its finished
    output by i (also tools/gates/resident_gate.py)."""
    eng = llm.engine
    rng = np.random.default_rng(seed)
    arrivals = sorted((int(rng.integers(0, 8)), i) for i in range(len(ps)))
    done, step = {}, 0
    while arrivals or eng.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            eng.add_request(str(i), ps[i], params)
        for out in eng.step():
            if out.finished:
                done[int(out.request_id)] = out
        step += 1
    return done


def test_batched_equals_isolated(make_llm):
    llm = make_llm(block_size=8, max_num_batched_tokens=40)
    ps = prompts(6, seed=5)
    alone = [llm.generate([p], GREEDY)[0] for p in ps]
    done = staggered(llm, ps, GREEDY)
    for i, a in enumerate(alone):
        assert_same(a, done[i])


def test_chunked_equals_unchunked(make_llm):
    ps = prompts(2, seed=7, lo=70, hi=100)
    a = make_llm().generate(ps, GREEDY)
    b = make_llm(max_num_batched_tokens=9).generate(ps, GREEDY)
    for x, y in zip(a, b):
        assert_same(x, y)


@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_equals_contiguous(make_llm, tiny_path, block_size):
    p = prompts(1, seed=8, lo=37, hi=38)[0]
    out = make_llm(block_size=block_size).generate([p], GREEDY)[0]
    assert out.token_ids == oracle_greedy(tiny_path, p, GREEDY.max_tokens)


def test_prefix_hit_equals_cold(make_llm):
    base = prompts(1, seed=9, lo=70, hi=71)[0]
    warm = make_llm(block_size=16)
    warm.generate([base + [1, 2]], GREEDY)
    hot = warm.generate([base + [3, 4, 5]], GREEDY)[0]
    assert hot.metrics.num_cached_tokens == 64
    cold = make_llm(enable_prefix_caching=False).generate([base + [3, 4, 5]], GREEDY)[0]
    assert_same(hot, cold)


def test_preemption_equals_isolated(make_llm):
    ps = prompts(5, seed=10, lo=20, hi=35)
    ref = make_llm().generate(ps, GREEDY)
    tight = make_llm(block_size=8, num_kv_blocks=12, max_model_len=96)
    out = tight.generate(ps, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    for x, y in zip(ref, out):
        assert_same(x, y)


def test_abort_frees_blocks(make_llm):
    llm = make_llm(block_size=8)
    eng = llm.engine
    eng.add_request("a", prompts(1, seed=11, lo=40, hi=41)[0], GREEDY)
    eng.step()
    assert eng.block_manager.num_used_blocks > 0
    eng.abort_request("a")
    assert eng.block_manager.num_used_blocks == 0
    eng.step()


def test_seeded_sampling_matches_oracle_sampler(make_llm, tiny_path, backend):
    """Device samplers equal kipp_core.sampling: the same seeded tokens as the oracle backend."""
    from kipp_core.llm import LLM

    sp = [
        SamplingParams(
            temperature=0.8,
            top_k=40,
            top_p=0.9,
            min_p=0.01,
            seed=s,
            max_tokens=6,
            presence_penalty=0.5,
            repetition_penalty=1.2,
            ignore_eos=True,
        )
        for s in range(4)
    ]
    p = prompts(1, seed=12)[0]
    got = [o.token_ids for o in make_llm().generate([p] * 4, sp)]
    ref = [o.token_ids for o in LLM(str(tiny_path)).generate([p] * 4, sp)]
    assert got == ref
