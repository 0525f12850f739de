"""The write timeout's one watcher: a write that waits past the timeout gets its verdict within a
check period after it, one that ends in time never does, and a timeout of 0 watches nothing."""

from __future__ import annotations

import asyncio

from kipp_core.server import write_watch
from kipp_core.server.write_watch import WriteWatch


def test_a_stalled_write_times_out_and_a_quick_one_does_not(monkeypatch):
    monkeypatch.setattr(write_watch, "CHECK_S", 0.05)

    async def go():
        watch, verdicts = WriteWatch(0.2), []
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        watch.began("stalled", lambda: verdicts.append(("stalled", loop.time() - t0)))
        for _ in range(8):  # quick writes, one after another, past the timeout in all
            watch.began("quick", lambda: verdicts.append(("quick", 0.0)))
            await asyncio.sleep(0.05)
            watch.ended("quick")
        await asyncio.sleep(0.1)
        watch.stop()
        return verdicts

    verdicts = asyncio.run(go())
    assert [k for k, _ in verdicts] == ["stalled"]
    assert 0.2 < verdicts[0][1] <= 0.2 + 0.05 + 0.5  # the timeout, a check period, a busy host


def test_no_timeout_watches_nothing():
    async def go():
        watch = WriteWatch(0)
        watch.began("w", lambda: None)
        return watch._task

    assert asyncio.run(go()) is None
