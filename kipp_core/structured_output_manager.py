"""The engine's structured outputs: each constrained request is made ready off the engine's
thread, then each of its sequences gets the mask of the tokens its constraint allows, a step at a
time (SamplerState.allowed, applied by every backend's sampler).

Making a request ready (one worker thread): the vocabulary's token table, built once and shared
by every request; the constraint over the compiled schema (StructuredOutputs.compiled, bounded by
json_schema.MAX_SCHEMA_SIZE); and its first mask. Meanwhile the request waits outside the
scheduler, as vLLM's WAITING_FOR_FSM, so a large schema never stalls the steps of the others.
The table's build belongs to the engine, not to any one request, so a client that goes away
while it is built cancels nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading

import numpy as np

from kipp_core.scheduler import QueueFullError
from kipp_core.structured_outputs import StructuredOutputs
from kipp_core.tokenizer import Tokenizer

log = logging.getLogger("kipp")


class StructuredOutputManager:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._pool: cf.ThreadPoolExecutor | None = None
        self._table: cf.Future | None = None
        self._lock = threading.Lock()
        self._compiling: dict[str, tuple] = {}  # request_id -> (Request, its constraint's future)
        self._constraints: dict[str, object] = {}  # request_id -> JsonConstraint / ToolCall...

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def add(self, req, speculative: bool, scheduler) -> None:
        """Start making the constraint of `req` (a kipp_core.request.Request), which `admit`
        puts into the scheduler's waiting queue when done. ValueError for a schema that does not
        compile (or speculative decoding), QueueFullError when the waiting queue (with the
        requests still compiling) has no room for its sequences."""
        if speculative:
            raise ValueError("structured_outputs is not available with speculative decoding")
        so = req.params.structured_outputs
        so.compiled()  # bounded by json_schema.MAX_SCHEMA_SIZE; done by the server beforehand
        held = sum(len(r.states) for r, _ in self._compiling.values())
        limit = scheduler.config.max_waiting
        if len(scheduler.waiting) + held + len(req.states) > limit:
            raise QueueFullError(f"waiting queue is full ({limit} requests)")
        self._table_future()
        fut = self._pool.submit(self._build, so, req.states[0].stop_ids)
        self._compiling[req.request_id] = (req, fut)

    def table(self):
        """The shared TokenTable (built at the first call, in the worker)."""
        return self._table_future().result()

    def _table_future(self) -> cf.Future:
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="kipp-structured")
                from kipp_core.json_constraint import TokenTable

                self._table = self._pool.submit(TokenTable, self.tokenizer, self.vocab_size)
            return self._table

    def _build(self, so: StructuredOutputs, stop_ids: tuple[int, ...]):
        from kipp_core.json_constraint import JsonConstraint
        from kipp_core.tool_constraint import ToolCallConstraint

        table, nodes = self._table.result(), so.compiled()
        if so.tools is not None:
            end = self.tokenizer.token_to_id("</tool_call>")
            names = [name for name, _ in so.tools]
            c = ToolCallConstraint(table, names, end, so.tool_call_opened, nodes)
        else:
            c = JsonConstraint(table, so.start_after, nodes)
        c.allowed(0, [], stop_ids)  # the first mask, cached in the table
        return c

    def admit(self, scheduler, wait: float = 0.0) -> list[str]:
        """Put the sequences of the requests whose constraints are made into the scheduler's
        waiting queue (after waiting up to `wait` seconds for one, when none is); returns the
        ids of those whose constraint failed (logged), for the engine to abort."""
        futs = [f for _, f in self._compiling.values()]
        if wait and not any(f.done() for f in futs):
            cf.wait(futs, wait, cf.FIRST_COMPLETED)
        failed = []
        for rid in [r for r, (_, f) in self._compiling.items() if f.done()]:
            req, fut = self._compiling.pop(rid)
            if fut.exception() is not None:
                log.error("structured outputs of %s failed", rid, exc_info=fut.exception())
                failed.append(rid)
                continue
            self._constraints[rid] = fut.result()
            scheduler.waiting.extend(st.seq for st in req.states if not st.seq.is_finished)
        return failed

    def mask(self, seq, stop_ids) -> np.ndarray | None:
        """Bool [vocab] (read-only): the tokens seq's constraint allows next, or None where it
        allows anything."""
        c = self._constraints.get(seq.request_id)
        if c is None:
            return None
        m = c.allowed(seq.stream, seq.output_token_ids, stop_ids)
        return m if m is not None and m.any() else None

    def release(self, request_id: str) -> None:
        """Forget the request (finished or aborted); a compile in flight is dropped when done."""
        self._constraints.pop(request_id, None)
        held = self._compiling.pop(request_id, None)
        if held is not None:
            held[1].cancel()
