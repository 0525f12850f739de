"""Engine gates on the oracle: batched equals isolated, chunked equals unchunked, paged equals
contiguous, prefix hit equals cold, no leaked blocks, and the limits."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kipp_core.sampling import SamplingParams
from kipp_core.scheduler import QueueFullError
from oracle.qwen3 import KVCache, forward
from tests.conftest import logprob_atol, rel_err

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


@pytest.fixture
def make_llm(llm_factory):
    return lambda **kw: llm_factory("oracle", **kw)


def prompts(n, seed=0, lo=3, hi=70):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 151000, size=int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def run_alone(llm, p, params=GREEDY):
    return llm.generate([p], params)[0]


def assert_same(a, b, tol=1e-4):
    assert a.token_ids == b.token_ids
    la = [x.logprob for x in a.outputs[0].logprobs]
    lb = [x.logprob for x in b.outputs[0].logprobs]
    np.testing.assert_allclose(la, lb, atol=tol)


def drive(llm, arrivals, params=GREEDY):
    """arrivals: list of (step, prompt). Add each at its step; return outputs by index."""
    eng = llm.engine
    done, step = {}, 0
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, p) = pending.pop(0)
            eng.add_request(f"r{i}", p, params)
        for out in eng.step():
            if out.finished:
                done[int(out.request_id[1:])] = out
        step += 1
    return [done[i] for i in range(len(arrivals))]


def test_paged_equals_contiguous_oracle(make_llm):
    llm = make_llm(block_size=4)
    p = prompts(1, seed=1)[0]
    out = run_alone(llm, p)
    w = llm.backend.weights
    cache = KVCache(w.config.num_hidden_layers)
    logits = forward(w, p, 0, cache)
    toks = []
    for _ in range(GREEDY.max_tokens):
        toks.append(int(np.argmax(logits[-1])))
        logits = forward(w, [toks[-1]], cache.length, cache)
    assert out.token_ids == toks


def test_batched_equals_isolated_random_arrivals(make_llm):
    llm = make_llm(block_size=8, max_num_batched_tokens=48)
    ps = prompts(7, seed=2)
    alone = [run_alone(llm, p) for p in ps]
    rng = np.random.default_rng(3)
    batched = drive(llm, [(int(rng.integers(0, 10)), p) for p in ps])
    for a, b in zip(alone, batched):
        assert_same(a, b)


def test_chunked_prefill_equals_unchunked(make_llm):
    ps = prompts(3, seed=4, lo=60, hi=120)
    big = make_llm(max_num_batched_tokens=4096).generate(ps, GREEDY)
    small = make_llm(max_num_batched_tokens=7).generate(ps, GREEDY)
    for a, b in zip(big, small):
        assert_same(a, b)


def test_chunked_prefill_does_not_stall_decodes(make_llm):
    llm = make_llm(max_num_batched_tokens=16)
    eng = llm.engine
    eng.add_request(
        "short", [1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    eng.step()
    eng.add_request("long", list(range(100, 400)), GREEDY)
    for _ in range(5):
        before = len(eng.requests["short"].states[0].seq.output_token_ids)
        eng.step()
        assert len(eng.requests["short"].states[0].seq.output_token_ids) == before + 1
    while eng.has_unfinished_requests():
        eng.step()


def test_prefix_hit_equals_cold(make_llm):
    base = prompts(1, seed=5, lo=100, hi=101)[0]
    a, b = base + [11, 12, 13], base + [21, 22]
    cold = make_llm(enable_prefix_caching=False)
    warm = make_llm(block_size=16)
    warm.generate([a], GREEDY)
    bm = warm.engine.block_manager
    hits_before = bm.hit_tokens
    hot = warm.generate([b], GREEDY)[0]
    assert bm.hit_tokens - hits_before == 96  # 6 full blocks of the shared 100-token prefix
    assert hot.metrics.num_cached_tokens == 96
    assert_same(hot, cold.generate([b], GREEDY)[0])


def test_prefix_collision_never_serves_other_kv(make_llm, monkeypatch):
    from kipp_core.block_manager import BlockManager

    monkeypatch.setattr(BlockManager, "chain_hash", staticmethod(lambda parent, ids: 7))
    llm = make_llm(block_size=8)
    p1, p2 = prompts(2, seed=6, lo=40, hi=41)
    llm.generate([p1], GREEDY)
    out = llm.generate([p2], GREEDY)[0]
    assert llm.engine.block_manager.hit_tokens == 0
    assert_same(out, make_llm(enable_prefix_caching=False).generate([p2], GREEDY)[0])


def test_preemption_under_kv_pressure_matches_isolated(make_llm):
    ps = prompts(6, seed=7, lo=20, hi=40)
    ref = make_llm().generate(ps, GREEDY)
    # 16 blocks of 8 = 128 tokens of KV for 6 requests of up to 52 tokens each.
    tight = make_llm(block_size=8, num_kv_blocks=16, max_model_len=128)
    outs = tight.generate(ps, GREEDY)
    assert tight.engine.scheduler.num_preemptions > 0
    for a, b in zip(ref, outs):
        assert_same(a, b)


def test_more_requests_than_max_num_seqs(make_llm):
    llm = make_llm(max_num_seqs=2)
    ps = prompts(5, seed=8)
    seen = []
    eng = llm.engine
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
        seen.append(len(eng.scheduler.running))
    assert max(seen) == 2


def test_prompts_at_context_limit(make_llm):
    llm = make_llm(max_model_len=64, block_size=8)
    p = prompts(1, seed=9, lo=63, hi=64)[0]
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="64 tokens, but the context holds 64"):
        llm.generate([p + [1]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([p[:60]], SamplingParams(max_tokens=10))


def test_queue_full_rejects(make_llm):
    llm = make_llm(max_waiting=2)
    eng = llm.engine
    eng.add_request("a", [1, 2], GREEDY)
    eng.add_request("b", [1, 2], GREEDY)
    with pytest.raises(QueueFullError):
        eng.add_request("c", [1, 2], GREEDY)
    eng.abort_request("a")
    eng.abort_request("b")
    eng.step()


def test_abort_frees_blocks_at_once(make_llm):
    llm = make_llm(block_size=8)
    eng = llm.engine
    eng.add_request("x", prompts(1, seed=10, lo=50, hi=51)[0], GREEDY)
    eng.step()
    assert eng.block_manager.num_used_blocks > 0
    assert eng.abort_request("x")
    assert eng.block_manager.num_used_blocks == 0
    outs = eng.step()
    assert outs[0].finish_reason == "abort" and outs[0].finished


def test_seeded_sampling_independent_of_batch(make_llm):
    llm = make_llm()
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    p = prompts(1, seed=11)[0]
    alone = llm.generate([p], sp)[0].token_ids
    others = prompts(4, seed=12)
    mixed = llm.generate(
        others[:2] + [p] + others[2:],
        [SamplingParams(temperature=1.0, max_tokens=10)] * 2
        + [sp]
        + [SamplingParams(temperature=0.5, max_tokens=5)] * 2,
    )
    assert mixed[2].token_ids == alone


def test_n_completions_differ_and_are_reproducible(make_llm):
    llm = make_llm()
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    a = llm.generate(["hello"], sp)[0]
    b = llm.generate(["hello"], sp)[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3


def test_stop_string_spanning_tokens_is_not_emitted(make_llm):
    llm = make_llm()
    free = llm.generate(["The sea"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[
        0
    ]
    text = free.text
    stop = text[5:9]  # spans a token boundary in general; the earliest match wins
    out = llm.generate(
        ["The sea"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    )[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.text == text[: text.find(stop)]


def test_stop_token_ids_and_min_tokens(make_llm):
    llm = make_llm()
    free = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    t = free.token_ids[3]
    first = free.token_ids.index(t)
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[t]))[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == t


def test_score_equals_oracle_log_softmax(make_llm):
    llm = make_llm(max_num_batched_tokens=16)
    ps = prompts(3, seed=13, lo=20, hi=40)
    scores = llm.score(ps, top_n=2)
    for p, sc in zip(ps, scores):
        logits = forward(llm.backend.weights, p).astype(np.float64)
        lp = logits - logits.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        assert sc[0] is None and len(sc) == len(p)
        got = [s.logprob for s in sc[1:]]
        want = [lp[i - 1, p[i]] for i in range(1, len(p))]
        # chunks of 16 against one pass: float32 sums in other orders (tests.conftest)
        cfg = llm.config
        terms = max(cfg.intermediate_size, cfg.hidden_size) + len(p)
        tol = logprob_atol(np.abs(logits).max(), terms, cfg.vocab_size)
        np.testing.assert_allclose(got, want, atol=tol)
        assert all(len(s.top) == 2 for s in sc[1:])


def test_logits_api_equals_oracle(make_llm):
    llm = make_llm(max_num_batched_tokens=10)
    p = prompts(1, seed=14, lo=33, hi=34)[0]
    got = llm.logits(p)
    assert got.dtype == np.float32 and got.shape == (33, 151936)
    assert rel_err(got, forward(llm.backend.weights, p)) <= 1e-5


def test_engine_metrics(make_llm):
    llm = make_llm()
    llm.generate(prompts(2, seed=15), GREEDY)
    m = llm.engine.metrics()
    assert m["num_running"] == 0 and m["num_waiting"] == 0 and m["kv_blocks_used"] == 0
    assert m["requests_finished"]["length"] == 2 and m["generation_tokens"] == 24


def test_final_only_requests_report_once_with_the_streamed_result(make_llm):
    """vLLM's FINAL_ONLY output kind (what LLM.generate uses): one RequestOutput, at the end,
    equal to the last cumulative output of the same request streamed step by step."""
    llm = make_llm()
    eng = llm.engine
    p = prompts(1, seed=5)[0]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True, logprobs=2)
    eng.add_request("streamed", p, params)
    eng.add_request("final", p, params, final_only=True)
    seen = {"streamed": [], "final": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    assert len(seen["streamed"]) == 9 and len(seen["final"]) == 1
    s, f = seen["streamed"][-1], seen["final"][0]
    assert f.finished and f.outputs[0].token_ids == s.outputs[0].token_ids
    assert f.outputs[0].text == s.outputs[0].text
    assert f.outputs[0].finish_reason == s.outputs[0].finish_reason == "length"
    # Its delta is the whole output: nothing was reported before.
    assert f.outputs[0].token_ids_delta == f.outputs[0].token_ids


@pytest.mark.parametrize("bad", [-1, "vocab", True, 3.0, np.int64(5), None])
def test_bad_prompt_token_is_named(make_llm, bad):
    """Every bad id is refused with a ValueError that names it, long prompts included (the fast
    whole-prompt check falls through to the loop that finds it), and the engine stays usable."""
    llm = make_llm()
    vocab = llm.engine.model_config.vocab_size
    bad = vocab if bad == "vocab" else bad
    ids = [5] * 3000
    ids[1234] = bad
    with pytest.raises(ValueError, match=re.escape(f"prompt token id {bad!r} is outside the")):
        llm.engine.add_request("bad", ids, GREEDY)
    assert "bad" not in llm.engine.requests
    assert run_alone(llm, [5, 6, 7]).token_ids
