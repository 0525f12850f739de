"""The LLMEngine behind an asyncio server: one worker thread owns the engine and loops `step()`
while there is work. Requests and aborts reach it through a thread-safe queue and are applied
between steps (so an abort frees its KV blocks before the next step runs); each step's outputs go
back to the event loop in one `call_soon_threadsafe`, to per-request queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kipp_core.engine import LLMEngine
from kipp_core.outputs import RequestOutput
from kipp_core.sampling import SamplingParams

log = logging.getLogger("kipp")

_STOP = object()


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    score_only: bool = False


class EngineFailure(Exception):
    """The engine raised while running this request; the request is gone."""


class RequestStream:
    """The outputs of one HTTP request's engine requests, as they arrive."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]):
        self._engine = engine
        self.request_ids = list(request_ids)
        self.unfinished = set(request_ids)
        self.finals: dict[str, RequestOutput] = {}
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, EngineFailure):
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
            self.finals[item.request_id] = item
        return item

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
        self._streams: dict[str, RequestStream] = {}  # touched on the loop thread only
        self.stats: dict = engine.metrics()  # replaced (never mutated) by the worker each step
        self._thread = threading.Thread(target=self._run, name="kipp-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=30)

    # -- the event loop's side -------------------------------------------------------------------

    async def submit(self, requests: list[EngineRequest], arrival_time: float) -> RequestStream:
        """Queue `requests` (all or none). Raises the engine's ValueError or QueueFullError."""
        stream = RequestStream(self, [r.request_id for r in requests])
        for rid in stream.request_ids:
            self._streams[rid] = stream
        done = self._loop.create_future()
        self._commands.put(("add", requests, arrival_time, done))
        try:
            await done
        except BaseException:
            stream.close()  # also aborts what the worker may have added before we were cancelled
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(("abort", request_ids))

    def _unregister(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                if self._on_finished is not None:
                    self._on_finished(out)
            if stream is not None:
                stream._queue.put_nowait(out)

    def _fail(self, request_ids: list[str], error: EngineFailure) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._queue.put_nowait(error)

    @staticmethod
    def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
        if fut.done():  # the handler was cancelled meanwhile; its close() aborts the requests
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: shutting down
            pass

    # -- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished_requests()
            cmd = self._commands.get() if not busy else self._next_command()
            while cmd is not None:
                if cmd is _STOP:
                    return
                self._apply(cmd)
                cmd = self._next_command()
            if engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception as e:
                    self._fail_all(e)
                    outputs = []
                if outputs:
                    self._post(self._dispatch, outputs)
            self.stats = engine.metrics()

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, cmd) -> None:
        if cmd[0] == "abort":
            for rid in cmd[1]:
                self.engine.abort_request(rid)
            return
        _, requests, arrival_time, done = cmd
        added = []
        try:
            for r in requests:
                self.engine.add_request(
                    r.request_id,
                    r.prompt_token_ids,
                    r.params,
                    prompt=r.prompt,
                    arrival_time=arrival_time,
                    score_only=r.score_only,
                )
                added.append(r.request_id)
        except Exception as e:
            for rid in added:
                self.engine.abort_request(rid)
            self._post(self._resolve, done, e)
            return
        self._post(self._resolve, done, None)

    def _fail_all(self, exc: Exception) -> None:
        """A step raised: fail every request in flight (any of them may be the cause), free their
        blocks, and keep serving."""
        log.error("engine step failed; aborting requests in flight", exc_info=exc)
        request_ids = self.engine.abort_all()
        error = EngineFailure(
            f"the inference engine failed while running this request ({type(exc).__name__}); "
            "it was aborted"
        )
        self._post(self._fail, request_ids, error)
