"""The write timeout of every event stream, kept by one task: a write records when it began and
clears it when done, and a check every CHECK_S aborts the connection of any write that has waited
longer than the timeout (a write waits only when the client stops reading and the socket's
buffers are full). One timer a write (asyncio.timeout) cost 15% of the event loop's time a
token at 256 streams (tools/profile/api_overhead.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

CHECK_S = 1.0  # at most this much past the timeout before a stalled write is aborted


class WriteWatch:
    def __init__(self, timeout: float):
        self.timeout = timeout  # seconds; 0: none
        self._began: dict[object, tuple[float, Callable[[], None]]] = {}
        self._task: asyncio.Task | None = None

    def began(self, key, on_timeout: Callable[[], None]) -> None:
        if not self.timeout:
            return
        loop = asyncio.get_running_loop()
        self._began[key] = (loop.time(), on_timeout)
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._check())

    def ended(self, key) -> None:
        self._began.pop(key, None)

    async def _check(self) -> None:
        loop = asyncio.get_running_loop()
        while self._began:
            await asyncio.sleep(min(CHECK_S, self.timeout / 2))
            now = loop.time()
            for key, (t, on_timeout) in list(self._began.items()):
                if now - t > self.timeout:
                    del self._began[key]
                    on_timeout()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
