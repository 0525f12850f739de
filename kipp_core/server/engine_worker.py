"""The engine's side of the server: the plain-data commands and messages that cross to the event
loop, and the loop that applies the commands between steps and steps while there is work.

Everything here is plain data (dataclasses of str, int, float and lists; picklable), so the same
worker runs on a thread of the API process (ThreadTransport) or in a process of its own
(kipp_core.server.engine_process): only the transport of `recv` and `post` differs. Commands are
applied between steps (an abort frees its KV blocks before the next step runs): AddRequests and
AbortRequests. The worker answers with one EngineMessage a step: every request's delta outputs,
the acknowledgements of the commands it applied, and the engine's stats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kipp_core.engine import LLMEngine
from kipp_core.outputs import RequestOutput
from kipp_core.request import TokenDelta
from kipp_core.sampling import SamplingParams
from kipp_core.scheduler import QueueFullError

log = logging.getLogger("kipp")

STOP = "stop"  # the command that ends the worker


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
    error: str | None = None  # the engine is gone (its process died): every stream fails
    deltas: list[TokenDelta] = field(default_factory=list)  # plain stream steps (request.py)


class EngineWorker:
    """Steps `engine` for as long as `recv` gives no STOP. `recv(block)` returns the next command
    (None when `block` is False and there is none); `post(msg)` delivers a step's message."""

    def __init__(
        self,
        engine: LLMEngine,
        recv: Callable[[bool], object],
        post: Callable[[EngineMessage], None],
    ):
        self.engine, self._recv, self._post = engine, recv, post

    def run(self) -> None:
        engine = self.engine
        while True:
            cmd = self._recv(True) if not engine.has_unfinished_requests() else None
            msg = EngineMessage()
            while True:
                if cmd == STOP:
                    return
                if cmd is not None:
                    self._apply(cmd, msg)
                cmd = self._recv(False)
                if cmd is None:
                    break
            if engine.has_unfinished_requests():
                try:
                    msg.outputs = engine.step(msg.deltas)
                except Exception as e:  # a fault the engine could not pin on a request
                    msg.deltas = []
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
