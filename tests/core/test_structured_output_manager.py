"""The engine's side of structured outputs: a constrained request waits outside the scheduler
while its constraint is made (off the engine's thread), the others run meanwhile; aborts, the
waiting queue's room, speculative decoding and bad values are handled at the door."""

from __future__ import annotations

import threading

import pytest

from kipp_core.sampling import SamplingParams
from kipp_core.scheduler import QueueFullError
from kipp_core.structured_outputs import StructuredOutputs, StructuredOutputsError

JSON = StructuredOutputs(json_object=True)


def _slow_build(engine, gate: threading.Event):
    """Hold every constraint's build until `gate` is set; record the thread it ran on."""
    manager, build, threads = engine.structured, engine.structured._build, []

    def slow(*a):
        threads.append(threading.current_thread())
        gate.wait(30)
        return build(*a)

    manager._build = slow
    return threads


def test_a_constrained_request_waits_for_its_constraint_and_others_run(llm_factory):
    llm = llm_factory()
    eng, gate = llm.engine, threading.Event()
    threads = _slow_build(eng, gate)
    ids = llm.tokenizer.encode("json please")
    eng.add_request("json", ids, SamplingParams(max_tokens=8, structured_outputs=JSON))
    eng.add_request("free", ids, SamplingParams(max_tokens=4, ignore_eos=True))
    done = {}
    while "free" not in done:
        for out in eng.step():
            done[out.request_id] = out
    assert not eng.requests["json"].states[0].seq.output_token_ids  # still waiting
    assert eng.requests["json"].states[0].seq not in eng.scheduler.waiting
    gate.set()
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
    assert done["json"].outputs[0].text.startswith("{")
    assert threads and threads[0] is not threading.current_thread()


def test_an_abort_while_compiling_frees_everything(llm_factory):
    llm = llm_factory()
    eng, gate = llm.engine, threading.Event()
    _slow_build(eng, gate)
    eng.add_request("json", [1, 2, 3], SamplingParams(max_tokens=4, structured_outputs=JSON))
    assert eng.abort_request("json")
    gate.set()
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.structured.num_compiling == 0 and not eng.structured._constraints


def test_the_waiting_room_counts_requests_still_compiling(llm_factory):
    llm = llm_factory(max_waiting=2)
    eng, gate = llm.engine, threading.Event()
    _slow_build(eng, gate)
    p = SamplingParams(max_tokens=2, n=2, structured_outputs=JSON)
    eng.add_request("a", [1, 2, 3], p)
    with pytest.raises(QueueFullError):
        eng.add_request("b", [1, 2, 3], p)
    gate.set()
    while eng.has_unfinished_requests():
        eng.step()


def test_bad_values_fail_at_the_door(llm_factory):
    eng = llm_factory().engine
    bad = StructuredOutputs(json_schema={"type": "tuple"})
    with pytest.raises(StructuredOutputsError, match="json_schema: unknown type"):
        eng.add_request("x", [1, 2], SamplingParams(structured_outputs=bad))
    tools = StructuredOutputs(tools=(("a", None), ("b", {"enum": []})))
    with pytest.raises(StructuredOutputsError, match=r"tools\[1\] parameters: enum") as e:
        eng.add_request("y", [1, 2], SamplingParams(structured_outputs=tools))
    assert e.value.tool == 1
    assert not eng.has_unfinished_requests()
    for kw, says in [
        ({}, "exactly one"),
        ({"json_object": True, "json_schema": {}}, "exactly one"),
        ({"json_object": 1}, "json_object must be a bool"),
        ({"tools": ()}, "tools must be"),
        ({"tools": (("a", "schema"),)}, "tools must be"),
        ({"tools": (("a", None), ("b", None)), "tool_call_opened": True}, "exactly one tool"),
        ({"json_object": True, "start_after": -1}, "start_after"),
    ]:
        with pytest.raises(ValueError, match=says):
            StructuredOutputs(**kw)
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json_object": True})


def test_speculative_decoding_refuses_constraints(llm_factory):
    eng = llm_factory(speculative="ngram").engine
    with pytest.raises(ValueError, match="speculative"):
        eng.add_request("x", [1, 2], SamplingParams(structured_outputs=JSON))
