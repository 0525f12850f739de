"""The prompt-end cache on every backend that offers it: a repeated prompt's first token comes from
the saved hidden state with no layer run, and everything after equals a cold run's."""

from __future__ import annotations

import pytest

from kipp_core.prompt_end import PromptEnds
from kipp_core.sampling import SamplingParams
from tests.conformance.test_backend_gates import GREEDY, assert_same, prompts


def _inputs(llm):
    """Record every SeqInput the backend is given."""
    seen = []
    backend = llm.engine.backend
    for name in ("execute", "execute_async"):
        fn = getattr(backend, name, None)
        if fn is None:
            continue

        def wrap(batch, fn=fn):
            seen.extend(batch.seqs)
            return fn(batch)

        setattr(backend, name, wrap)
    return seen


def _with_slots(make_llm, **kw):
    llm = make_llm(block_size=16, **kw)
    if not getattr(llm.engine.backend, "num_hidden_slots", 0):
        pytest.skip(f"{type(llm.engine.backend).__name__} keeps no hidden states")
    return llm


@pytest.mark.parametrize("length", [70, 64])  # a tail of 6 tokens; none (block-aligned)
def test_prompt_end_hit_equals_cold(make_llm, length):
    p = prompts(1, seed=20, lo=length, hi=length + 1)[0]
    llm = _with_slots(make_llm)
    first = llm.generate([p], GREEDY)[0]
    seen = _inputs(llm)
    hot = llm.generate([p], GREEDY)[0]
    assert hot.metrics.num_cached_tokens == length
    hit = [s for s in seen if s.cached_hidden is not None]
    assert len(hit) == 1 and hit[0].token_ids == [] and seen[0] is hit[0]
    assert (hit[0].copy_block is None) == (length % 16 == 0)
    assert llm.engine.block_manager.ends.hits == 1
    cold = make_llm(enable_prefix_caching=False).generate([p], GREEDY)[0]
    assert_same(first, cold)
    assert_same(hot, cold)


def test_prompt_end_seeded_sampling_equals_cold(make_llm):
    p = prompts(1, seed=21, lo=50, hi=51)[0]
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True)
    llm = _with_slots(make_llm)
    llm.generate([p], GREEDY)
    hot = llm.generate([p], sp)[0]
    cold = make_llm(enable_prefix_caching=False).generate([p], sp)[0]
    assert llm.engine.block_manager.ends.hits == 1
    assert hot.token_ids == cold.token_ids


def test_prompt_end_survives_the_first_requests_decode(make_llm):
    """The first request writes its own tokens after the tail, in the same block; the hit copies
    the block while that request is still running, and sees only the prompt's tail."""
    p = prompts(1, seed=22, lo=40, hi=41)[0]
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = _with_slots(make_llm)
    eng = llm.engine
    eng.add_request("a", p, long)
    while not eng.block_manager.ends.entries:
        eng.step()
    eng.add_request("b", p, GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert eng.block_manager.ends.hits == 1
    cold = make_llm(enable_prefix_caching=False)
    assert_same(done["b"], cold.generate([p], GREEDY)[0])
    assert done["a"].token_ids == cold.generate([p], long)[0].token_ids


def test_prompt_end_eviction_and_tight_pool(make_llm):
    """Two slots for three prompts: the oldest entry goes, and its prompt is computed again (only
    its full blocks hit). A pool this small also reuses entries' tail blocks."""
    ps = prompts(3, seed=23, lo=36, hi=37)
    llm = _with_slots(make_llm, num_kv_blocks=12, max_model_len=96)
    bm = llm.engine.block_manager
    bm.ends = PromptEnds(2)
    for q in ps:
        llm.generate([q], GREEDY)
    assert len(bm.ends.entries) == 2
    again = llm.generate([ps[0]], GREEDY)[0]
    assert bm.ends.hits == 0 and again.metrics.num_cached_tokens < 36
    hot = llm.generate([ps[2]], GREEDY)[0]
    cold = make_llm(enable_prefix_caching=False)
    assert_same(again, cold.generate([ps[0]], GREEDY)[0])
    if bm.ends.hits:  # the pool may have taken ps[2]'s tail block back meanwhile
        assert hot.metrics.num_cached_tokens == 36
    assert_same(hot, cold.generate([ps[2]], GREEDY)[0])


def test_prompt_end_not_with_prompt_logprobs(make_llm):
    p = prompts(1, seed=24, lo=40, hi=41)[0]
    llm = _with_slots(make_llm)
    llm.generate([p], GREEDY)
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    out = llm.generate([p], sp)[0]
    assert llm.engine.block_manager.ends.hits == 0
    assert len(out.prompt_logprobs) == len(p)


def test_prompt_end_with_q8_0_kv(make_llm, backend):
    """The tail copy moves a q8_0 KV block's values and its scales."""
    if backend == "oracle":
        pytest.skip("the oracle keeps unquantized KV only")
    p = prompts(1, seed=25, lo=45, hi=46)[0]
    llm = _with_slots(make_llm, kv_quant="q8_0")
    llm.generate([p], GREEDY)
    hot = llm.generate([p], GREEDY)[0]
    assert llm.engine.block_manager.ends.hits == 1
    cold = make_llm(kv_quant="q8_0", enable_prefix_caching=False).generate([p], GREEDY)[0]
    assert_same(hot, cold)


def test_prompt_end_random_traffic_equals_cold(make_llm):
    """Rounds of batched requests that repeat, extend and cut each other's prompts, over a pool
    small enough to evict entries and hand out their tail blocks again: every output equals a
    cold run of its prompt."""
    import numpy as np

    rng = np.random.default_rng(25)
    stems = prompts(2, seed=25, lo=40, hi=41)
    pool = [s[:n] for s in stems for n in (17, 33, 40)]  # tails of 1, 1 and 8 tokens
    pool += prompts(2, seed=26, lo=33, hi=41)  # unrelated: other contents for reused blocks
    # 8 blocks and 4 slots: entries live while their full blocks are reused (3 such lookups)
    llm = _with_slots(make_llm, num_kv_blocks=8, max_model_len=96)
    bm = llm.engine.block_manager
    bm.ends = PromptEnds(4)
    cold = make_llm(enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want: dict[tuple[int, ...], list[int]] = {}
    for _ in range(10):
        batch = [pool[i] for i in rng.integers(0, len(pool), 3)]
        for p, out in zip(batch, llm.generate(batch, sp)):
            if tuple(p) not in want:
                want[tuple(p)] = cold.generate([p], sp)[0].token_ids
            assert out.token_ids == want[tuple(p)], p
    assert bm.ends.hits > 0, "no prompt-end hit: the test did not exercise the cache"
    bm.check_all_free()
