"""The engine process's wire format: a step's messages come back equal to what the engine made,
every field of every output (logprobs, prompt logprobs, n > 1, stop reasons, an error), and the
acks and stats untouched."""

from __future__ import annotations

import pickle

from kipp_core.outputs import RequestMetrics, RequestOutput
from kipp_core.sampling import SamplingParams
from kipp_core.server.engine_worker import Ack, EngineMessage
from kipp_core.server.wire import pack, unpack


def test_engine_messages_round_trip(llm_factory):
    llm = llm_factory("oracle")
    eng = llm.engine
    p = SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=6, logprobs=2, prompt_logprobs=1)
    eng.add_request("a", [11, 22, 33], p, delta=True)
    stop = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[0], ignore_eos=True)
    eng.add_request("b", [44, 55], stop, delta=True)
    messages = []
    while eng.has_unfinished_requests():
        messages.append(EngineMessage(eng.step(), [Ack(3), Ack(4, "no", "invalid")], eng.metrics()))
    failed = RequestOutput("c", [], [], True, RequestMetrics(1.0), error="the engine failed")
    messages.append(EngineMessage([failed], error="gone"))
    assert any(o.outputs[0].logprobs_delta for m in messages for o in m.outputs)
    assert any(o.prompt_logprobs for m in messages for o in m.outputs)
    for msg in messages:
        got = unpack(pickle.loads(pickle.dumps(pack(msg), pickle.HIGHEST_PROTOCOL)))
        assert got == msg
        assert all(type(o) is RequestOutput for o in got.outputs)
