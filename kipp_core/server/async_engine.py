"""The LLMEngine behind an asyncio server. The engine runs in an EngineWorker
(kipp_core.server.engine_worker) on a thread of this process (ThreadTransport) or in a process of
its own (kipp_core.server.engine_process); either way only plain data crosses: commands to the
worker, one EngineMessage a step back. On the loop, each request's deltas wait in its
RequestStream, merged into one when its client falls behind (vLLM's output collector), so a
stream holds at most what its client has not read.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import threading
from collections.abc import Callable

from kipp_core.engine import LLMEngine
from kipp_core.outputs import CompletionOutput, RequestMetrics, RequestOutput, merge_outputs
from kipp_core.scheduler import QueueFullError
from kipp_core.server.engine_worker import (
    STOP,
    AbortRequests,
    Ack,
    AddRequests,
    EngineMessage,
    EngineRequest,
    EngineWorker,
)

log = logging.getLogger("kipp")


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
        self.metrics[out.request_id] = copy.copy(out.metrics)  # put_delta counts on in it
        self._queue(out)

    def put_delta(self, rid: str, text: str, token_ids: list[int]) -> None:
        """A TokenDelta (kipp_core/request.py) as the RequestOutput the engine would have made,
        with the request's latest metrics, its output count advanced (the access log of a stream
        that ends early reads it; a handler reads only a final output's metrics)."""
        m = self.metrics[rid]
        m.num_output_tokens += len(token_ids)
        c = CompletionOutput(0, text, token_ids, None, None, None, text, token_ids, [])
        self._queue(RequestOutput(rid, [], [c], False, m))

    def _queue(self, out: RequestOutput) -> None:
        """out waits for the reader, merged with what it has not read yet."""
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
    """The event loop's side of the engine: submit, abort, and each step's EngineMessage handed
    to the streams. `engine` is an LLMEngine (run by a worker thread in this process) or a
    transport (kipp_core.server.engine_process.EngineProcess: the engine in a process of its
    own); either carries the same plain-data commands and messages."""

    def __init__(
        self,
        engine,
        loop: asyncio.AbstractEventLoop,
        on_finished: Callable[[RequestOutput], None] | None = None,
    ):
        self.transport = engine if hasattr(engine, "send") else ThreadTransport(engine)
        self._loop = loop
        self._on_finished = on_finished
        self._streams: dict[str, RequestStream] = {}  # the loop's side only, as are _acks
        self._acks: dict[int, asyncio.Future] = {}
        self._batch_ids = itertools.count()
        self.stats: dict = self.transport.initial_stats()  # the worker's latest snapshot
        self.dead: str | None = None  # why the engine is gone (its process exited)

    def start(self) -> None:
        self.transport.start(self._post)

    def stop(self) -> None:
        self.transport.stop()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # -- the event loop's side -------------------------------------------------------------------

    async def submit(self, requests: list[EngineRequest], arrival_time: float) -> RequestStream:
        """Queue `requests` (all or none). Raises ValueError or QueueFullError."""
        if self.dead is not None:
            raise EngineFailure(self.dead)
        stream = RequestStream(self, [r.request_id for r in requests])
        for rid in stream.request_ids:
            self._streams[rid] = stream
        batch_id = next(self._batch_ids)
        done = self._acks[batch_id] = self._loop.create_future()
        self.transport.send(AddRequests(batch_id, requests, arrival_time))
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
        self.transport.send(AbortRequests(list(request_ids), error))

    def abort_all(self, error: str) -> None:
        """End every stream with `error` (a shutdown's deadline has passed)."""
        self.abort(list(self._streams), error)

    def _unregister(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    def _receive(self, msg: EngineMessage) -> None:
        if msg.error is not None:  # the engine is gone: every request with it
            self.dead = msg.error
            for fut in self._acks.values():
                if not fut.done():
                    fut.set_result(Ack(-1, msg.error, "internal"))
            for rid, stream in list(self._streams.items()):
                stream.put(RequestOutput(rid, [], [], True, RequestMetrics(0.0), error=msg.error))
            self._streams.clear()
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
        for rid, text, ids in msg.deltas:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_delta(rid, text, ids)
        if msg.stats is not None:
            self.stats = msg.stats

    def _post(self, msg: EngineMessage) -> None:
        try:
            self._loop.call_soon_threadsafe(self._receive, msg)
        except RuntimeError:  # the loop is closed: shutting down
            pass


class ThreadTransport:
    """The engine in this process, stepped by a worker thread (tests, `LLM` users, and `kipp
    serve --engine-in-process`)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def initial_stats(self) -> dict:
        return self.engine.metrics()

    def start(self, post: Callable[[EngineMessage], None]) -> None:
        worker = EngineWorker(self.engine, self._recv, post)
        self._thread = threading.Thread(target=worker.run, name="kipp-engine", daemon=True)
        self._thread.start()

    def send(self, cmd) -> None:
        self._commands.put(cmd)

    def _recv(self, block: bool):
        try:
            return self._commands.get(block)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self._commands.put(STOP)
        if self._thread is not None:
            self._thread.join(timeout=30)
