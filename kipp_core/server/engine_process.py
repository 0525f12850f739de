"""The engine in a process of its own (vLLM's engine core): the API process keeps HTTP, JSON,
tokenizing and SSE; the engine process keeps the scheduler, the backend and detokenizing. Each
has its own GIL, so the event loop's work no longer takes turns with the engine's host work
(on an H200, 256 streams got 42% of the engine's offline throughput when both shared one GIL).

The same EngineWorker as in-process serving runs in the child; commands and its per-step
EngineMessages cross as pickles of plain data (the messages' outputs as tuples: wire.py) over two
one-way pipes, a writer thread sending the commands (a full pipe never blocks the event loop) and a
reader thread receiving the messages; in the child a sender thread writes them, so a full pipe
never holds up a step. The child is spawned (never forked: CUDA and MLX do not
survive a fork), loads the model, and says "ready" or why not. If it dies, every stream ends with an
error and new requests get 500s; if the API process goes away, the child's pipe closes and it stops.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Callable

from kipp_core.gc_heap import freeze_loaded_heap
from kipp_core.server.engine_worker import STOP, EngineMessage, EngineWorker
from kipp_core.server.wire import pack, unpack

log = logging.getLogger("kipp")

_DUMP = pickle.HIGHEST_PROTOCOL


def _child(model: str, llm_kwargs: dict, cmd_conn, msg_conn, log_level: int) -> None:
    # A terminal's Ctrl-C and a service manager's SIGTERM reach the whole process group: the API
    # process drains its requests first and then stops this one (STOP, or its pipe closing).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="kipp: %(message)s")
    try:
        from kipp_core.llm import LLM

        llm = LLM(model, **llm_kwargs)
    except Exception as e:  # reported to the API process, which answers 503 with it
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        msg_conn.send_bytes(pickle.dumps(("error", why), _DUMP))
        return
    freeze_loaded_heap()  # the model and tokenizer, out of the collector's full passes
    msg_conn.send_bytes(pickle.dumps(("ready", llm.engine.metrics()), _DUMP))

    def recv(block: bool):
        if not block and not cmd_conn.poll():
            return None
        try:
            return pickle.loads(cmd_conn.recv_bytes())
        except (EOFError, OSError):  # the API process is gone
            return STOP

    # A thread of its own writes the messages (vLLM's engine core sends from one too): the
    # pipe holds about three steps' messages, so a step would otherwise wait whenever the API
    # process is slow to read (0.23 ms a step on average at 256 streams, up to 2.8 ms, on a
    # 2-core CPU).
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send() -> None:
        while (data := outbox.get()) is not None:
            try:
                msg_conn.send_bytes(data)
            except OSError:  # the API process is gone; recv() returns STOP
                return

    sender = threading.Thread(target=send, name="kipp-engine-sender", daemon=True)
    sender.start()

    def post(msg: EngineMessage) -> None:
        outbox.put(pickle.dumps(pack(msg), _DUMP))

    EngineWorker(llm.engine, recv, post).run()
    outbox.put(None)  # the last messages go out before the process ends
    sender.join()


class EngineProcess:
    """A transport for kipp_core.server.async_engine.AsyncEngine: the LLM(model, **llm_kwargs)
    in a spawned process. `launch()` blocks until the model is loaded (ValueError with the
    child's reason if it could not be)."""

    def __init__(self, model: str, llm_kwargs: dict, child: Callable = _child):
        # child: the process's function, _child's arguments (a profile swaps the model out)
        ctx = multiprocessing.get_context("spawn")
        self._cmd_r, self._cmd_w = ctx.Pipe(duplex=False)
        self._msg_r, self._msg_w = ctx.Pipe(duplex=False)
        level = logging.getLogger("kipp").getEffectiveLevel()
        self._proc = ctx.Process(
            target=child,
            args=(model, llm_kwargs, self._cmd_r, self._msg_w, level),
            name="kipp-engine",
            daemon=True,
        )
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stats: dict = {}
        self._threads: list[threading.Thread] = []

    def launch(self) -> None:
        self._proc.start()
        self._cmd_r.close()  # the child's ends
        self._msg_w.close()
        try:
            kind, payload = pickle.loads(self._msg_r.recv_bytes())
        except EOFError:
            self._proc.join(5)
            raise ValueError(
                f"the engine process exited while loading (exit code {self._proc.exitcode})"
            ) from None
        if kind == "error":
            self._proc.join(5)
            raise ValueError(payload)
        self._stats = payload

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def initial_stats(self) -> dict:
        return self._stats

    def start(self, post: Callable[[EngineMessage], None]) -> None:
        def read() -> None:
            while True:
                try:
                    data = self._msg_r.recv_bytes()
                except (EOFError, OSError):
                    break
                post(unpack(pickle.loads(data)))
            if self._proc.is_alive():
                self._proc.join(5)
            code = self._proc.exitcode
            if code not in (0, None) or not self._stopping:
                log.error("the engine process exited (exit code %s)", code)
                post(EngineMessage(error=f"the inference engine exited (exit code {code})"))

        def write() -> None:
            while True:
                cmd = self._outbox.get()
                try:
                    self._cmd_w.send_bytes(pickle.dumps(cmd, _DUMP))
                except (BrokenPipeError, OSError):
                    return
                if cmd == STOP:
                    return

        self._stopping = False
        for name, fn in (("kipp-engine-reader", read), ("kipp-engine-writer", write)):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def send(self, cmd) -> None:
        self._outbox.put(cmd)

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._outbox.put(STOP)
        self._proc.join(timeout)
        if self._proc.is_alive():  # SIGKILL: the child ignores SIGTERM (see _child)
            log.warning("the engine process did not stop in %.0f s; killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        for t in self._threads:
            t.join(5)
