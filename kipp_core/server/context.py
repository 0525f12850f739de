"""What the request handlers share: the loaded model behind its AsyncEngine, or the fact that it is
still loading (503)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from kipp_core.frontend import Frontend
from kipp_core.llm import LLM
from kipp_core.scheduler import QueueFullError
from kipp_core.server.async_engine import AsyncEngine, EngineRequest, RequestStream
from kipp_core.server.errors import APIError, bad_request
from kipp_core.server.offload import Offload


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    api_key: str | None = None
    served_model_name: str | None = None  # default: the --model argument
    max_body_bytes: int = 16 << 20  # 413 above this
    keepalive_timeout: float = 5.0  # idle keep-alive connections are closed after this (uvicorn's)
    retry_after_s: int = 1  # the Retry-After of a 429
    write_timeout: float = 30.0  # a stream whose client takes no data this long is aborted
    body_timeout: float = 30.0  # a request body must arrive within this (408)
    shutdown_timeout: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    access_log: bool = True  # one line a request on the kipp.access logger
    # Without an API key, only these Host names (and loopback ones) are served: a browser page
    # cannot reach the server by DNS rebinding. "*" allows any.
    allowed_hosts: tuple[str, ...] = ()
    # a chat request without max_tokens: at most this many (None: the rest of the context)
    default_max_tokens: int | None = None
    # a chat request that thinks and sets no budget: this one (None: no budget)
    default_thinking_budget: int | None = None


@dataclass
class ServingContext:
    """`front`: the model's tokenizer, template, defaults and limits (an LLM's `frontend`, or one
    the API process made while the engine process loads); `llm`: the LLM itself when the engine
    runs in this process."""

    front: Frontend
    engine: AsyncEngine
    model_name: str
    llm: LLM | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    default_max_tokens: int | None = None  # ServerConfig's
    default_thinking_budget: int | None = None  # ServerConfig's

    def __post_init__(self):
        f = self.front
        self.tokenizer = f.tokenizer
        self.chat_template = f.chat_template
        self.max_model_len = f.max_model_len
        self.vocab_size = f.vocab_size
        self.defaults = f.default_sampling_params()
        self.max_waiting = f.max_waiting
        self.offload = Offload(getattr(self.tokenizer, "model_dir", None))
        # NFC (the tokenizer's normalizer) shrinks UTF-8 at most 3x (three jamo, 9 bytes, make
        # one Hangul syllable of 3), and no token holds more than this many bytes:
        self.bytes_per_token = 3 * max(len(b) for b in self.tokenizer._bytes)

    def encode(self, text: str, what: str = "prompt") -> list[int]:
        """Token ids of `text` (off the GIL's way for a long one: offload.py; call it from a
        worker thread). A text that must hold more tokens than the context is a 400 at once."""
        least = len(text.encode("utf-8", "surrogatepass")) // self.bytes_per_token
        if least >= self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the {what} "
                f"holds at least {least} tokens. Please reduce the length of the {what}.",
                what,
            )
        return self.offload.encode(self.tokenizer, text)

    @staticmethod
    def new_id(prefix: str) -> str:
        """A fresh id: "chatcmpl" gives "chatcmpl-HEX", "msg_" gives "msg_HEX"."""
        return f"{prefix}{'' if prefix.endswith('_') else '-'}{uuid.uuid4().hex}"

    async def submit(
        self, requests: list[EngineRequest], arrival_time: float, retry_after_s: int
    ) -> RequestStream:
        """Queue the engine requests of one HTTP request: 400 for what the engine rejects or
        what can never fit its waiting queue, 429 with Retry-After when that queue is full."""
        seqs = sum(r.params.n for r in requests)
        if seqs > self.max_waiting:
            raise bad_request(
                f"the request has {seqs} sequences (prompts x n) but the server queues at most "
                f"{self.max_waiting}",
                "n",
            )
        try:
            return await self.engine.submit(requests, arrival_time)
        except QueueFullError as e:
            raise APIError(
                429,
                f"the server is busy: {e}; retry later",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry_after_s)},
            ) from None
        except ValueError as e:
            raise bad_request(str(e)) from None


class ServerState:
    """The app's view of the model: None while loading."""

    def __init__(self, config: ServerConfig, model_name: str):
        self.config = config
        self.model_name = model_name
        self.ctx: ServingContext | None = None
        self.load_error: str | None = None
        self.metrics = None  # a ServerMetrics, set by the app factory
        self.draining = False  # shutting down: new requests get 503
        self.inflight = 0  # generation requests being handled

    def ready(self) -> ServingContext:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.ctx is not None:
            if self.ctx.engine.dead is not None:
                raise APIError(503, self.ctx.engine.dead, code="engine_dead")
            return self.ctx
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}")
        raise APIError(
            503,
            "the model is loading; retry shortly",
            code="model_loading",
            headers={"Retry-After": str(self.config.retry_after_s)},
        )

    def engine_stats(self) -> dict | None:
        return None if self.ctx is None else self.ctx.engine.stats


STATE = web.AppKey("kipp_state", ServerState)
