"""Running the server: bind the socket first, load the model in the background (so /health answers
503 meanwhile), then serve until stopped. `ServerThread` runs one on its own loop in a thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from kipp_core.frontend import Frontend
from kipp_core.llm import LLM
from kipp_core.server.app import create_app
from kipp_core.server.async_engine import AsyncEngine
from kipp_core.server.context import ServerConfig, ServerState, ServingContext
from kipp_core.server.engine_process import EngineProcess
from kipp_core.server.http_layer import use_kipp_handlers

log = logging.getLogger("kipp")


def default_model_name(llm: LLM) -> str:
    entry = llm.registry_entry
    return entry.name if entry is not None else Path(llm.checkpoint.path).name


class APIServer:
    """The OpenAI-compatible server over one LLM: pass a loaded `llm`, a `loader` that returns
    one (run in a worker thread after the socket is bound), or `engine_process`, which returns
    the front end and the EngineProcess that will hold the engine (`kipp serve`'s default)."""

    def __init__(
        self,
        config: ServerConfig,
        llm: LLM | None = None,
        loader: Callable[[], LLM] | None = None,
        model_name: str | None = None,
        engine_process: Callable[[], tuple[Frontend, EngineProcess]] | None = None,
    ):
        if sum(x is not None for x in (llm, loader, engine_process)) != 1:
            raise ValueError("pass exactly one of llm, loader and engine_process")
        self.config = config
        self._llm, self._loader, self._process = llm, loader, engine_process
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
        use_kipp_handlers(self._runner)
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
        loop = asyncio.get_running_loop()
        try:
            if self._process is not None:
                front, proc = await loop.run_in_executor(None, self._launch)
            else:
                llm = await loop.run_in_executor(None, self._loader)
        except Exception as e:
            self.state.load_error = (
                f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
            )
            self.loaded.set_exception(e)
            return
        if self._process is not None:
            log.info("engine process %d loaded the model", proc.pid)
            self._serve(front, proc)
        else:
            self._attach(llm)

    def _launch(self) -> tuple[Frontend, EngineProcess]:
        """The front end here, the engine in its process (loaded when this returns)."""
        front, proc = self._process()
        proc.launch()
        return front, proc

    def _attach(self, llm: LLM) -> None:
        self._serve(llm.frontend, llm.engine, llm)

    def _serve(self, front: Frontend, engine, llm: LLM | None = None) -> None:
        engine = AsyncEngine(engine, asyncio.get_running_loop(), self.state.metrics.observe)
        engine.start()
        cap = self.config.default_max_tokens
        self.state.ctx = ServingContext(
            front,
            engine,
            self.state.model_name,
            llm,
            default_max_tokens=cap,
            default_thinking_budget=self.config.default_thinking_budget,
        )
        log.info(
            "chat requests without max_tokens generate up to %s",
            f"{cap} tokens" if cap else f"the rest of the {front.max_model_len}-token context",
        )
        if not self.loaded.done():
            self.loaded.set_result(None)

    async def drain(self, timeout: float) -> None:
        """Graceful shutdown: stop accepting (new requests on open connections get 503), give
        the requests in flight `timeout` seconds to finish, then end the rest with an error
        event (a stream) or an error body, and stop."""
        self.state.draining = True
        for site in list(self._runner.sites):
            await site.stop()
        ctx = self.state.ctx
        if ctx is not None:
            deadline = asyncio.get_running_loop().time() + timeout
            while ctx.engine.num_streams and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            if ctx.engine.num_streams:
                log.warning(
                    "shutdown: aborting %d request(s) still running", ctx.engine.num_streams
                )
                ctx.engine.abort_all("the server is shutting down; the request was aborted")
            while self.state.inflight:  # their handlers write the final events
                await asyncio.sleep(0.02)
        await self.stop()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self.state.ctx is not None:
            self.state.ctx.engine.stop()
            self.state.ctx.offload.close()


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
