"""SIGTERM drains `kipp serve`: with 4 streaming and 2 non-streaming requests in flight, each gets
a complete response or a final error event, none a cut stream or an empty reply, and the exit
code is 0; a second signal exits at once."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import aiohttp
import pytest

from tests.server.conftest import sse_events, unread_stream


def serve(*args: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kipp_core.cli.main", "serve", "--model", "kipp-tiny"]
    cmd += ["--backend", "oracle", "--port", str(port), *args]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)


BODY = {"prompt": "drain", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


async def _stream(s, url) -> str:
    done, events = await sse_events(s, url, BODY)
    assert done, "a cut stream"
    if "error" in events[-1]:
        return "error event"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    return "complete"


async def _plain(s, url) -> str:
    async with s.post(url + "/v1/completions", json=BODY) as r:
        body = await r.json()  # an empty or cut reply fails here
    if r.status == 200:
        assert body["choices"][0]["finish_reason"] == "length"
        return "complete"
    assert set(body) == {"error"} and r.status >= 500
    return "error body"


async def _in_flight(proc, url) -> list[str]:
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.ensure_future(_stream(s, url)) for _ in range(4)]
        tasks += [asyncio.ensure_future(_plain(s, url)) for _ in range(2)]
        await asyncio.sleep(1.5)  # all six are running
        proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*tasks)


@pytest.mark.parametrize(("timeout", "outcome"), [("60", "complete"), ("0.5", "error")])
def test_sigterm_drains_requests_in_flight(timeout, outcome):
    proc, url = serve("--shutdown-timeout", timeout)
    try:
        results = asyncio.run(_in_flight(proc, url))
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    assert all(r.startswith(outcome) for r in results), results


def test_a_second_signal_exits_at_once():
    proc, url = serve("--shutdown-timeout", "60")
    try:
        s = unread_stream(int(url.rsplit(":", 1)[1]), {**BODY, "max_tokens": 3000, "stream": True})
        s.recv(100)  # it is streaming
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None  # draining
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) != 0 and time.monotonic() - t < 5
        s.close()
    finally:
        proc.kill()
