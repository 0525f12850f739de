"""Async scheduling on the CUDA backend (run here on the CPU): the engine queues step N+1 before
it reads step N's samples, which N+1 takes as PENDING tokens on the device. The reference is the
synchronous loop on the same backend (itself gated against the oracle): every output must be the
same, token for token, for every kind of request, under chunked prefill and under preemption."""

from __future__ import annotations

import pytest

from kipp_core.backend import PENDING
from kipp_core.sampling import SamplingParams

pytest.importorskip("torch")

P = SamplingParams
MIXED = [
    P(temperature=0, max_tokens=12, ignore_eos=True),
    P(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True),
    P(temperature=0.9, top_p=0.9, top_k=20, seed=2, max_tokens=9, ignore_eos=True),
    P(
        temperature=0.7,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        seed=3,
        max_tokens=8,
        ignore_eos=True,
    ),
    P(temperature=1.0, n=2, seed=4, max_tokens=7, ignore_eos=True),
    P(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True),
    P(temperature=0.6, min_tokens=3, stop_token_ids=[5, 6, 7], seed=5, max_tokens=11),
    P(temperature=0, max_tokens=1),
    P(temperature=1.2, seed=6, max_tokens=9, stop=["a", "e"]),
]


def _prompts(n: int) -> list[list[int]]:
    return [[(37 * i + 11 * j) % 200 + 3 for j in range(5 + 7 * i)] for i in range(n)]


def _lp(lps):
    """Logprobs to 1e-4: the two loops batch sequences differently, which moves float32 sums
    in the last bits (the tokens themselves must be identical)."""
    return [
        None if t is None else (t.token_id, round(t.logprob, 4), [i for i, _ in t.top])
        for t in lps or []
    ]


def _summary(outs):
    return [
        [(c.token_ids, c.text, c.finish_reason, _lp(c.logprobs)) for c in o.outputs]
        + [_lp(o.prompt_logprobs)]
        for o in outs
    ]


def _spy(llm):
    """Record every batch the engine queues."""
    seen = []
    inner = llm.engine.backend.execute_async

    def spy(batch):
        seen.append(batch)
        return inner(batch)

    llm.engine.backend.execute_async = spy
    return seen


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_num_batched_tokens=16),  # chunked prefills beside running decodes
        dict(num_kv_blocks=12, max_model_len=96, max_num_batched_tokens=64),  # preemption
    ],
    ids=["chunked", "preempting"],
)
def test_async_equals_sync(llm_factory, kw):
    prompts = _prompts(len(MIXED))
    common = dict(backend="cuda", dtype="float32", block_size=8, **kw)
    sync = llm_factory(async_scheduling=False, **common)
    want = sync.generate(prompts, MIXED)
    llm = llm_factory(**common)
    seen = _spy(llm)
    got = llm.generate(prompts, MIXED)
    assert _summary(got) == _summary(want)
    pending = [s for b in seen for s in b.seqs if PENDING in s.token_ids]
    assert len(pending) > 20, "the async path never fed a sample back on the device"
    if "num_kv_blocks" in kw:
        assert llm.engine.scheduler.num_preemptions > 0


def test_penalties_wait_for_their_pending_token(llm_factory):
    """A penalty needs the last sample's value: such a sequence is never queued behind it."""
    llm = llm_factory("cuda", dtype="float32", block_size=8)
    seen = _spy(llm)
    pen = P(temperature=0.7, frequency_penalty=0.4, seed=9, max_tokens=8, ignore_eos=True)
    plain = P(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(_prompts(2), [pen, plain])
    with_pending = [s for b in seen for s in b.seqs if PENDING in s.token_ids]
    assert with_pending and all(not s.sampler.params.frequency_penalty for s in with_pending)


def test_abort_while_a_step_is_in_flight(llm_factory):
    """Aborting a request whose sample is still on the device frees it at once and leaves the
    other request's output unchanged."""
    greedy = P(temperature=0, max_tokens=10, ignore_eos=True)
    a, b = _prompts(2)
    ref = llm_factory("cuda", dtype="float32", async_scheduling=False).generate([b], greedy)
    llm = llm_factory("cuda", dtype="float32")
    eng = llm.engine
    eng.add_request("a", a, greedy)
    eng.add_request("b", b, greedy)
    for _ in range(3):
        eng.step()
    assert eng._inflight is not None
    assert eng.abort_request("a")
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
    assert done["a"].outputs[0].finish_reason == "abort"
    assert done["b"].outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_context_limit_is_exact(llm_factory):
    """A request that fills the context to the last position stops there, as in sync mode."""
    prompt = _prompts(3)[2]
    params = P(temperature=0, max_tokens=40 - len(prompt), ignore_eos=True)
    kw = dict(dtype="float32", block_size=8, max_model_len=40)
    want = llm_factory("cuda", async_scheduling=False, **kw).generate([prompt], params)
    got = llm_factory("cuda", **kw).generate([prompt], params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert len(got[0].outputs[0].token_ids) == 40 - len(prompt)
