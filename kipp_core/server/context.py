"""What the request handlers share: the loaded model behind its AsyncEngine, or the fact that it is
still loading (503)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from kipp_core.llm import LLM
from kipp_core.scheduler import QueueFullError
from kipp_core.server.async_engine import AsyncEngine, EngineRequest, RequestStream
from kipp_core.server.errors import APIError, bad_request


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    api_key: str | None = None
    served_model_name: str | None = None  # default: the --model argument
    max_body_bytes: int = 16 << 20  # 413 above this
    keepalive_timeout: float = 5.0  # idle keep-alive connections are closed after this (uvicorn's)
    retry_after_s: int = 1  # the Retry-After of a 429
    # a chat request without max_tokens: at most this many (None: the rest of the context)
    default_max_tokens: int | None = None


@dataclass
class ServingContext:
    llm: LLM
    engine: AsyncEngine
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    default_max_tokens: int | None = None  # ServerConfig's

    def __post_init__(self):
        self.tokenizer = self.llm.tokenizer
        self.max_model_len = self.llm.engine.max_model_len
        self.vocab_size = self.llm.engine.model_config.vocab_size
        self.defaults = self.llm.default_sampling_params()

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def submit(
        self, requests: list[EngineRequest], arrival_time: float, retry_after_s: int
    ) -> RequestStream:
        """Queue the engine requests of one HTTP request: 400 for what the engine rejects, 429
        with Retry-After when its waiting queue is full."""
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

    def ready(self) -> ServingContext:
        if self.ctx is not None:
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
