"""One request's `n` cannot starve another. On the oracle, whose step costs the sum of its
sequences, a 20-token stream beside an n=128 request runs in as many steps as alone, each of two
sequences (an equal share: the victim's one and one of the 128), with the same tokens; so its time
is bounded by its steps, not by the 128 (the wall-clock ratio is a benchmark's: tools/profile/
server_probe.py fairness). With one request, or requests of one sequence each, nothing changes."""

from __future__ import annotations

import pytest

from kipp_core.sampling import SamplingParams
from kipp_core.scheduler import SERIAL_STEP_SEQS

VICTIM = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
BIG = SamplingParams(temperature=0.8, seed=4, n=128, max_tokens=400, ignore_eos=True)


def _victim(engine, ids, rows: list[int]) -> tuple[list[int], list[int]]:
    """The victim's tokens, and the rows of each step from its arrival to its last token."""
    start, tokens = len(rows), []
    engine.add_request("victim", ids, VICTIM, delta=True)  # as the server asks
    while True:
        for out in engine.step():
            if out.request_id == "victim":
                tokens += out.token_ids
                if out.finished:
                    return tokens, rows[start:]


@pytest.mark.parametrize("backend", ["oracle", "cuda"])  # cuda: on a CPU, its torch references
def test_a_stream_beside_n_128_takes_its_own_steps(llm_factory, backend):
    if backend == "cuda":
        pytest.importorskip("torch")
    llm = llm_factory(backend, dtype="float32")
    engine, tok = llm.engine, llm.tokenizer
    rows: list[int] = []
    for name in ("execute", "execute_async"):
        run = getattr(engine.backend, name, None)
        if run is not None:
            spy = lambda batch, run=run: rows.append(len(batch.seqs)) or run(batch)  # noqa: E731
            setattr(engine.backend, name, spy)
    ids = tok.encode("a victim stream")
    want, alone = _victim(engine, ids, rows)
    assert alone == [1] * len(alone)
    engine.add_request("big", tok.encode("tell me a long story"), BIG, delta=True)
    for _ in range(3):
        engine.step()
    got, beside = _victim(engine, ids, rows)
    engine.abort_request("big")
    engine.step()
    assert got == want
    assert len(beside) <= len(alone) + 1  # a seat in every step (at most one waited for)
    # the first step may be the big one's short step (SERIAL_STEP_SEQS), and with async
    # scheduling the last the one queued after the victim's; between them equal shares: the
    # victim's one sequence and one of the 128, so each step costs about two of its steps alone
    assert max(beside) <= SERIAL_STEP_SEQS and max(beside[1 : len(alone)]) == 2


def test_the_share_is_whole_for_one_request(llm_factory):
    llm = llm_factory("oracle")
    engine = llm.engine
    engine.add_request("big", [1, 2, 3], SamplingParams(n=3, max_tokens=2, ignore_eos=True))
    assert len(engine.scheduler.schedule()) == 3
    engine.abort_request("big")
    engine.step()


def test_one_request_alone_runs_at_most_a_short_step(llm_factory):
    """So that a request arriving during the step waits for a short one (SERIAL_STEP_SEQS)."""
    llm = llm_factory("oracle")
    engine = llm.engine
    engine.add_request("big", [1, 2, 3], SamplingParams(n=40, max_tokens=2, ignore_eos=True))
    assert len(engine.scheduler.schedule()) == SERIAL_STEP_SEQS == 4
    engine.abort_request("big")
    engine.step()
