"""Failure isolation: a step that raises fails only the requests it can blame.

The step's requests become suspects. Every sequence of theirs is reset (its KV blocks freed, to
be recomputed as after a preemption; the tokens it produced stay) and parked outside the
scheduler. The suspects then run one at a time, each alone in a step of its own, alternating
with the steps of everything else, until each of its sequences has sampled a token: a suspect
whose solo step raises is the cause and fails; the others rejoin the batch with the same tokens
they would have had (sampling noise is a function of the step). A step with one request to blame
fails it at once, and so does a third suspicion of the same request, so that a fault that needs
two requests together cannot loop.
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from kipp_core.scheduler import Scheduler
from kipp_core.sequence import Sequence

MAX_SUSPICIONS = 3

log = logging.getLogger("kipp")


class Quarantine:
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.parked: dict[str, list[Sequence]] = {}  # suspects not yet let back into the queue
        self.queue: deque[str] = deque()  # suspects in the order of their solo runs
        self.marks: dict[str, dict[int, int]] = {}  # rid -> seq_id -> outputs at its reset
        self.suspicions: Counter[str] = Counter()
        self._turn = False
        self._alone: str | None = None  # the suspect whose own step is running

    def __bool__(self) -> bool:
        return bool(self.marks)

    def holds(self, seq: Sequence) -> bool:
        """Whether seq waits out a batch step (its request runs only alone until cleared)."""
        return seq.request_id in self.marks

    def run_alone(self, engine, rid: str) -> None:
        """rid's step on its own, synchronously, once the queued async step (if any) is done."""
        if engine._inflight is not None:
            prev, engine._inflight = engine._inflight, None
            engine._blame = {s.seq.request_id for s in prev[0]}
            engine._finish_inflight(prev)
        engine._blame = {rid}
        self._alone = rid
        engine._step_sync(only=self.unpark(rid))
        self._alone = None
        req = engine.requests.get(rid)
        if req is not None:
            self.check_cleared(rid, [st.seq for st in req.states])

    def recover(self, engine, exc: Exception) -> None:
        """After `engine`'s step raised `exc`: fail or park the requests it blames."""
        engine._inflight = None
        blamed = sorted(r for r in engine._blame if r in engine.requests)
        if not blamed:
            raise exc
        fail, retry = self.triage(blamed)
        self._alone = None
        log.warning(
            "engine step failed (%s: %s): %d request(s) failed, %d to run alone",
            type(exc).__name__,
            exc,
            len(fail),
            len(retry),
            exc_info=exc if fail else None,
        )
        for rid in fail:
            engine.requests[rid].error = (
                f"the inference engine failed while running this request "
                f"({type(exc).__name__}); it was aborted"
            )
            engine.abort_request(rid)
        for rid in retry:
            self.park(rid, [st.seq for st in engine.requests[rid].states])
        for seq in list(self.scheduler.running):  # a sample lost with the failed step
            if seq.num_pending:
                self.scheduler.reset(seq)

    def triage(self, blamed: list[str]) -> tuple[list[str], list[str]]:
        """(requests to fail now, requests to run alone) after a step that blamed `blamed`."""
        if self._alone is not None or len(blamed) == 1:
            return blamed, []
        fail, retry = [], []
        for rid in blamed:
            self.suspicions[rid] += 1
            (fail if self.suspicions[rid] >= MAX_SUSPICIONS else retry).append(rid)
        return fail, retry

    def park(self, rid: str, seqs: list[Sequence]) -> None:
        live = [s for s in seqs if not s.is_finished]
        for s in live:
            self.scheduler.reset(s)
            self.scheduler.waiting.remove(s)
        self.parked[rid] = live
        self.marks[rid] = {s.seq_id: len(s.output_token_ids) for s in live}
        if rid not in self.queue:
            self.queue.append(rid)

    def next_solo(self) -> str | None:
        """The suspect whose solo step this is (every other step while there are suspects)."""
        while self.queue and self.queue[0] not in self.marks:
            self.queue.popleft()
        if not self.queue:
            return None
        self._turn = not self._turn
        return self.queue[0] if self._turn else None

    def unpark(self, rid: str) -> set[int]:
        """Put rid's parked sequences at the head of the waiting queue; their seq ids."""
        for s in reversed(self.parked.pop(rid, [])):
            self.scheduler.waiting.appendleft(s)
        return set(self.marks.get(rid, {}))

    def check_cleared(self, rid: str, seqs: list[Sequence]) -> None:
        marks = self.marks.get(rid)
        if marks is not None and all(
            s.is_finished or len(s.output_token_ids) > marks.get(s.seq_id, -1) for s in seqs
        ):
            self.release(rid)

    def release(self, rid: str) -> None:
        """rid is cleared, failed or gone."""
        self.marks.pop(rid, None)
        self.parked.pop(rid, None)
