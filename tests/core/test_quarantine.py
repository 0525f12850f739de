"""Failure isolation on the oracle: a step that raises fails only the request that causes it; the
others finish with the tokens they have alone, and every KV block is freed."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.outputs import merge_outputs
from kipp_core.sampling import SamplingParams

BAD = 151_000  # a prompt holding this token id makes the backend raise
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


class Faulty:
    """Raises when a sequence whose prompt holds BAD samples its `at_step`-th token or later,
    or (with `pair`) when both of two marked requests' sequences are in one step."""

    def __init__(self, inner, at_step: int = 3, pair: tuple[int, int] | None = None):
        self.inner, self.at_step, self.pair = inner, at_step, pair
        self.config, self.block_size, self.num_blocks = (
            inner.config,
            inner.block_size,
            inner.num_blocks,
        )
        self.calls = 0

    def execute(self, batch):
        self.calls += 1
        marks = set()
        for s in batch.seqs:
            st = s.sampler
            if st is None:
                continue
            if BAD in st.prompt_token_ids and st.step >= self.at_step:
                raise RuntimeError("injected fault")
            marks.update(t for t in (self.pair or ()) if t in st.prompt_token_ids)
        if self.pair and marks == set(self.pair):
            raise RuntimeError("injected pair fault")
        return self.inner.execute(batch)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 150_000, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


def run(engine, items, delta: bool = False, max_steps: int = 500) -> dict:
    for rid, ids, p in items:
        engine.add_request(rid, ids, p, delta=delta)
    done, merged = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            rid = out.request_id
            merged[rid] = merge_outputs(merged[rid], out) if rid in merged else out
            if out.finished:
                done[rid] = merged[rid] if delta else out
    assert not engine.has_unfinished_requests(), "the engine did not finish"
    engine.block_manager.check_all_free()
    return done


@pytest.mark.parametrize("at_step", [0, 3])
def test_a_failing_request_fails_alone(llm_factory, at_step):
    llm = llm_factory("oracle")
    good = prompts(4)
    alone = [llm.generate([p], PARAMS)[0].token_ids for p in good]
    llm.engine.backend = Faulty(llm.engine.backend, at_step)
    items = [(f"g{i}", p, PARAMS) for i, p in enumerate(good)]
    items.insert(2, ("bad", [5, BAD, 7], PARAMS))
    done = run(llm.engine, items, delta=True)
    assert done["bad"].error and "engine failed" in done["bad"].error
    assert done["bad"].outputs[0].finish_reason == "abort"
    assert len(done["bad"].outputs[0].token_ids) == at_step  # what it made before the fault
    for i, want in enumerate(alone):
        out = done[f"g{i}"]
        assert out.error is None and out.token_ids == want


def test_n_children_and_prompt_logprobs_survive_a_reset(llm_factory):
    """A suspect's sequences are recomputed from their first token: n > 1 and prompt logprobs
    come out as they do alone."""
    llm = llm_factory("oracle")
    p = SamplingParams(temperature=0.8, seed=4, n=3, max_tokens=8, ignore_eos=True,
                       prompt_logprobs=2)  # fmt: skip
    ids = prompts(1, seed=5)[0]
    want = llm.generate([ids], p)[0]
    llm.engine.backend = Faulty(llm.engine.backend, at_step=2)
    done = run(llm.engine, [("ok", ids, p), ("bad", [BAD, 1, 2], PARAMS)])
    got = done["ok"]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert len(got.prompt_logprobs) == len(ids)
    np.testing.assert_allclose(
        [x.logprob for x in got.prompt_logprobs[1:]],
        [x.logprob for x in want.prompt_logprobs[1:]],
        atol=1e-5,
    )
    assert done["bad"].error


def test_a_fault_that_needs_two_requests_cannot_loop(llm_factory):
    llm = llm_factory("oracle")
    a, b = 140_001, 140_002
    llm.engine.backend = Faulty(llm.engine.backend, at_step=10**9, pair=(a, b))
    items = [("a", [a, 3, 4], PARAMS), ("b", [b, 5, 6], PARAMS), ("c", [9, 9, 9], PARAMS)]
    done = run(llm.engine, items, max_steps=300)
    assert done["c"].error is None and len(done["c"].token_ids) == PARAMS.max_tokens
    assert done["a"].error or done["b"].error  # one of the pair goes; nothing loops


def test_generate_raises_on_a_failed_request(llm_factory):
    llm = llm_factory("oracle")
    llm.engine.backend = Faulty(llm.engine.backend, at_step=0)
    with pytest.raises(RuntimeError, match="engine failed"):
        llm.generate([[BAD, 1], [2, 3]], PARAMS)
