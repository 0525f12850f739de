"""A plain stream step crosses to the API process as a TokenDelta tuple (kipp_core/request.py,
take_token_delta), which its RequestStream turns back into a RequestOutput. The reference is
engine.step() without them, every step a RequestOutput: what each stream reads after each step
must be the same, through the wire, for n = 1 and n = 2, logprobs, a stop string, an abort, and a
client that falls behind (its deltas merged). Mid-stream metrics are the request's latest full
output's (only a final output's are read: usage, the access log), so they are compared at the
finals only (their counts; the clock readings differ between two runs)."""

from __future__ import annotations

import asyncio
import pickle

from kipp_core.sampling import SamplingParams
from kipp_core.server.async_engine import RequestStream
from kipp_core.server.engine_worker import EngineMessage
from kipp_core.server.wire import pack, unpack

REQUESTS = {
    "greedy": SamplingParams(temperature=0, max_tokens=14, ignore_eos=True),
    "sampled": SamplingParams(temperature=1.0, seed=5, max_tokens=11, stop=["e"]),
    "n2": SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=7),
    "logprobs": SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True),
    "aborted": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    "slow": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
}
PROMPT = [5, 17, 29, 41, 53, 65, 77]


def counts(eng, rid: str, stream: RequestStream) -> int:
    """rid's tokens made so far: the engine's own, or the final output's once it is gone."""
    req = eng.requests.get(rid)
    if req is None:
        return stream._pending[rid].metrics.num_output_tokens
    return sum(len(st.seq.output_token_ids) for st in req.states)


def _read(stream: RequestStream, n: int) -> list:
    async def take():
        return [await stream.__anext__() for _ in range(n)]

    return asyncio.run(take())


def _run(llm, token_deltas: bool):
    eng = llm.engine
    for i, (rid, params) in enumerate(REQUESTS.items()):
        eng.add_request(rid, PROMPT[: 3 + i], params, delta=True)
    fast = {rid: RequestStream(None, [rid]) for rid in REQUESTS}
    reads, steps, num_deltas = [], 0, 0
    while eng.has_unfinished_requests():
        steps += 1
        if steps == 4:
            eng.abort_request("aborted")
        msg = EngineMessage()
        msg.outputs = eng.step(msg.deltas if token_deltas else None)
        msg = unpack(pickle.loads(pickle.dumps(pack(msg), pickle.HIGHEST_PROTOCOL)))
        num_deltas += len(msg.deltas)
        news = {o.request_id for o in msg.outputs} | {d[0] for d in msg.deltas}
        for out in msg.outputs:
            fast[out.request_id].put(out)
        for rid, text, ids in msg.deltas:
            fast[rid].put_delta(rid, text, ids)
        for rid in news:  # the stream's count follows the engine's (the access log reads it)
            assert fast[rid].metrics[rid].num_output_tokens == counts(eng, rid, fast[rid])
        for rid in sorted(news):
            # "slow" is read every third step and when done: what is pending is merged
            if rid == "slow" and steps % 3 and not fast[rid]._pending[rid].finished:
                continue
            reads.append((steps, _read(fast[rid], 1)[0]))
    return reads, num_deltas


def _key(out) -> tuple:
    return (
        out.request_id,
        out.prompt_token_ids,
        out.outputs,
        out.finished,
        out.prompt,
        out.prompt_logprobs,
        out.error,
        _counts(out.metrics) if out.finished else None,
    )


def _counts(m) -> tuple:  # the clock readings differ between two runs; which are set does not
    times = (m.first_scheduled_time, m.first_token_time, m.finished_time)
    return m.num_prompt_tokens, m.num_output_tokens, m.num_cached_tokens, [t is None for t in times]


def test_token_deltas_read_as_the_plain_outputs(llm_factory):
    ref, none = _run(llm_factory("oracle", kv_cache_memory="64MiB"), token_deltas=False)
    got, num = _run(llm_factory("oracle", kv_cache_memory="64MiB"), token_deltas=True)
    assert none == 0
    assert num >= 25  # most of greedy's, sampled's and slow's steps went as tuples
    assert [(s, _key(o)) for s, o in got] == [(s, _key(o)) for s, o in ref]
    finals = {o.request_id: o for _, o in got if o.finished}
    assert set(finals) == set(REQUESTS)
    assert finals["aborted"].outputs[0].finish_reason == "abort"
    assert finals["greedy"].metrics.num_output_tokens == 14
    assert all(o.outputs[0].logprobs_delta for _, o in got if o.request_id == "logprobs")
    # the slow reader's merged reads hold every token once, in order
    slow = [tok for _, o in got if o.request_id == "slow" for tok in o.outputs[0].token_ids]
    assert len(slow) == 12 and len([1 for _, o in got if o.request_id == "slow"]) < 12


def test_a_plain_step_is_a_tuple_only_when_that_is_all_it_says(llm_factory):
    eng = llm_factory("oracle").engine
    eng.add_request("a", [3, 4, 5], REQUESTS["greedy"], delta=True)
    eng.add_request("b", [3, 4, 5], REQUESTS["greedy"])  # not a stream: a RequestOutput each
    first, kinds = [], []
    while eng.has_unfinished_requests():
        deltas = []
        outs = eng.step(deltas)
        first = first or outs
        kinds.append(({o.request_id for o in outs}, [d[0] for d in deltas]))
    assert {o.request_id for o in first} == {"a", "b"}  # a's first output holds its prompt
    assert kinds[-1][0] == {"a", "b"}  # so does the last (finish reason, metrics)
    assert all(d == ["a"] and outs == {"b"} for outs, d in kinds[1:-1])
