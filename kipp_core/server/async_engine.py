"""The LLMEngine behind an asyncio server: one worker thread owns the engine and loops `step()`
while there is work.

Everything that crosses between the worker and the event loop is plain data (dataclasses of
str, int, float and lists; picklable), so that moving the engine into a process of its own
would change the transport only. Commands go to the worker through a queue and are applied
between steps (an abort frees its KV blocks before the next step runs): AddRequests and
AbortRequests. The worker answers with one EngineMessage per step: the step's delta outputs of
every request, the acknowledgements of the commands it applied, and the engine's stats. On the
loop, each request's deltas wait in its RequestStream, merged into one when its client falls
behind (vLLM's output collector), so a stream holds at most what its client has not read.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kipp_core.engine import LLMEngine
from kipp_core.outputs import RequestMetrics, RequestOutput, merge_outputs
from kipp_core.sampling import SamplingParams
from kipp_core.scheduler import QueueFullError

log = logging.getLogger("kipp")

_STOP = object()


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    score_only: bool = False


@dataclass
class AddRequests:
    batch_id: int
    requests: list[EngineRequest]
    arrival_time: float


@dataclass
class AbortRequests:
    request_ids: list[str]
    error: str | None = None  # set: their streams end with this error (a shutdown)


@dataclass
class Ack:
    batch_id: int
    error: str | None = None  # None: added
    kind: str = ""  # of the error: "invalid" (ValueError), "queue_full", "internal"


@dataclass
class EngineMessage:
    outputs: list[RequestOutput] = field(default_factory=list)
    acks: list[Ack] = field(default_factory=list)
    stats: dict | None = None


class EngineFailure(Exception):
    """The engine failed while running this request; the request is gone."""


class RequestStream:
    """The outputs of one HTTP request's engine requests, as they arrive: iterate for deltas
    (one per engine request that has news, merged since the last read), or `collect()` them."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]):
        self._engine = engine
        self.request_ids = list(request_ids)
        self.unfinished = set(request_ids)
        self.finals: dict[str, RequestOutput] = {}  # each request's last output (its metrics)
        self.metrics: dict[str, RequestMetrics] = {}  # each request's latest (the access log)
        self._pending: dict[str, RequestOutput] = {}
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def put(self, out: RequestOutput) -> None:
        self.metrics[out.request_id] = out.metrics
        prev = self._pending.get(out.request_id)
        self._pending[out.request_id] = out if prev is None else merge_outputs(prev, out)
        self._ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        rid = next(iter(self._pending))
        out = self._pending.pop(rid)
        if out.error is not None:
            self.unfinished.clear()
            raise EngineFailure(out.error)
        if out.finished:
            self.unfinished.discard(rid)
            self.finals[rid] = out
        return out

    async def collect(self) -> list[RequestOutput]:
        """Every request's whole output (texts, ids and logprobs summed up), in order."""
        total: dict[str, RequestOutput] = {}
        async for out in self:
            rid = out.request_id
            total[rid] = merge_outputs(total[rid], out) if rid in total else out
        return [total[rid] for rid in self.request_ids]

    def close(self) -> None:
        """Abort what has not finished (the client left, or the handler failed)."""
        self._engine._unregister(self.request_ids)
        if self.unfinished:
            self._engine.abort(list(self.unfinished))
            self.unfinished.clear()


class AsyncEngine:
    """Drives `engine` from a worker thread on behalf of the event loop `loop`."""

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ):
        self.engine = engine
        self._loop = loop
        self._on_finished = on_finished
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # the loop's side only, as are _acks
        self._acks: dict[int, asyncio.Future] = {}
        self._batch_ids = itertools.count()
        self.stats: dict = engine.metrics()  # the worker's latest snapshot
        self._thread = threading.Thread(target=self._run, name="kipp-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=30)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- the event loop's side -------------------------------------------------------------------

    async def submit(self, requests: list[EngineRequest], arrival_time: float) -> RequestStream:
        """Queue `requests` (all or none). Raises ValueError or QueueFullError."""
        stream = RequestStream(self, [r.request_id for r in requests])
        for rid in stream.request_ids:
            self._streams[rid] = stream
        batch_id = next(self._batch_ids)
        done = self._acks[batch_id] = self._loop.create_future()
        self._commands.put(AddRequests(batch_id, requests, arrival_time))
        try:
            ack = await done
        except BaseException:
            stream.close()  # also aborts what the worker may have added before we were cancelled
            raise
        finally:
            self._acks.pop(batch_id, None)
        if ack.error is not None:
            stream.close()
            kinds = {"invalid": ValueError, "queue_full": QueueFullError}
            raise kinds.get(ack.kind, EngineFailure)(ack.error)
        return stream

    def abort(self, request_ids: list[str], error: str | None = None) -> None:
        self._commands.put(AbortRequests(list(request_ids), error))

    def abort_all(self, error: str) -> None:
        """End every stream with `error` (a shutdown's deadline has passed)."""
        self.abort(list(self._streams), error)

    def _unregister(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    def _receive(self, msg: EngineMessage) -> None:
        for ack in msg.acks:
            fut = self._acks.get(ack.batch_id)
            if fut is not None and not fut.done():  # (a cancelled handler aborts on its own)
                fut.set_result(ack)
        for out in msg.outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                if self._on_finished is not None:
                    self._on_finished(out)
            if stream is not None:
                stream.put(out)
        if msg.stats is not None:
            self.stats = msg.stats

    def _post(self, msg: EngineMessage) -> None:
        try:
            self._loop.call_soon_threadsafe(self._receive, msg)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    # -- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            cmd = self._commands.get() if not engine.has_unfinished_requests() else None
            msg = EngineMessage()
            while True:
                if cmd is _STOP:
                    return
                if cmd is not None:
                    self._apply(cmd, msg)
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
            if engine.has_unfinished_requests():
                try:
                    msg.outputs = engine.step()
                except Exception as e:  # a fault the engine could not pin on a request
                    msg.outputs = self._fail_all(e)
            msg.stats = engine.metrics()
            self._post(msg)

    def _apply(self, cmd, msg: EngineMessage) -> None:
        if isinstance(cmd, AbortRequests):
            for rid in cmd.request_ids:
                req = self.engine.requests.get(rid)
                if req is not None and cmd.error is not None:
                    req.error = cmd.error
                self.engine.abort_request(rid)
            return
        added = []
        try:
            for r in cmd.requests:
                self.engine.add_request(
                    r.request_id,
                    r.prompt_token_ids,
                    r.params,
                    prompt=r.prompt,
                    arrival_time=cmd.arrival_time,
                    score_only=r.score_only,
                    delta=True,
                )
                added.append(r.request_id)
        except Exception as e:
            for rid in added:
                self.engine.abort_request(rid)
            if isinstance(e, QueueFullError):
                kind = "queue_full"
            elif isinstance(e, ValueError):
                kind = "invalid"
            else:
                kind = "internal"
                log.error("adding a request failed", exc_info=e)
            msg.acks.append(Ack(cmd.batch_id, str(e), kind))
            return
        msg.acks.append(Ack(cmd.batch_id))

    def _fail_all(self, exc: Exception) -> list[RequestOutput]:
        log.error("engine step failed; aborting every request in flight", exc_info=exc)
        error = (
            f"the inference engine failed while running this request ({type(exc).__name__}); "
            "it was aborted"
        )
        outs = []
        for rid in list(self.engine.requests):
            self.engine.requests[rid].error = error
            self.engine.abort_request(rid)
        for out in self.engine.step():  # reports the aborted requests
            outs.append(out)
        return outs
