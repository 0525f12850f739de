"""Running the server: bind the socket first, load the model in the background (so /health answers
503 meanwhile), then serve until stopped. `ServerThread` runs one on its own loop in a thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from kipp_core.llm import LLM
from kipp_core.server.app import create_app
from kipp_core.server.async_engine import AsyncEngine
from kipp_core.server.context import ServerConfig, ServerState, ServingContext

log = logging.getLogger("kipp")


def default_model_name(llm: LLM) -> str:
    entry = llm.registry_entry
    return entry.name if entry is not None else Path(llm.checkpoint.path).name


class APIServer:
    """The OpenAI-compatible server over one LLM: pass a loaded `llm`, or a `loader` that
    returns one (run in a worker thread after the socket is bound)."""

    def __init__(
        self,
        config: ServerConfig,
        llm: LLM | None = None,
        loader: Callable[[], LLM] | None = None,
        model_name: str | None = None,
    ):
        if (llm is None) == (loader is None):
            raise ValueError("pass exactly one of llm and loader")
        self.config = config
        self._llm, self._loader = llm, loader
        name = config.served_model_name or model_name
        if name is None:
            name = default_model_name(llm) if llm is not None else "model"
        self.state = ServerState(config, name)
        self.port: int | None = None
        self.loaded: asyncio.Future | None = None  # done when loaded; raises if loading failed
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.loaded = loop.create_future()
        self._runner = web.AppRunner(
            create_app(self.state),
            handler_cancellation=True,  # a client that disconnects cancels its handler
            keepalive_timeout=self.config.keepalive_timeout,
            access_log=None,
            shutdown_timeout=2.0,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        try:
            await site.start()
        except OSError as e:
            await self._runner.cleanup()
            raise ValueError(
                f"cannot listen on {self.config.host}:{self.config.port}: {e}"
            ) from None
        self.port = self._runner.addresses[0][1]
        if self._llm is not None:
            self._attach(self._llm)
        else:
            asyncio.ensure_future(self._load())

    async def _load(self) -> None:
        try:
            llm = await asyncio.get_running_loop().run_in_executor(None, self._loader)
        except Exception as e:
            self.state.load_error = (
                f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
            )
            self.loaded.set_exception(e)
            return
        self._attach(llm)

    def _attach(self, llm: LLM) -> None:
        engine = AsyncEngine(llm.engine, asyncio.get_running_loop(), self.state.metrics.observe)
        engine.start()
        cap = self.config.default_max_tokens
        self.state.ctx = ServingContext(llm, engine, self.state.model_name, default_max_tokens=cap)
        log.info(
            "chat requests without max_tokens generate up to %s",
            f"{cap} tokens" if cap else f"the rest of the {llm.engine.max_model_len}-token context",
        )
        if not self.loaded.done():
            self.loaded.set_result(None)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.state.ctx is not None:
            self.state.ctx.engine.stop()


class ServerThread:
    """An APIServer on its own event loop in a daemon thread (tests, benchmarks)."""

    def __init__(self, server: APIServer):
        self.server = server
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="kipp-server", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.server.config.host}:{self.server.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(timeout)
        return self

    def wait_loaded(self, timeout: float = 120.0) -> None:
        async def wait():
            await self.server.loaded

        asyncio.run_coroutine_threadsafe(wait(), self.loop).result(timeout)

    def call(self, fn, *args, timeout: float = 30.0):
        """Run `fn(*args)` on the server's loop and return its result."""

        async def run():
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        self.loop.close()
