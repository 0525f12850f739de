"""`kipp serve` runs the engine in a process of its own by default: its answers equal the
offline engine's through the official client; the engine process ignores a signal to the whole
process group (a terminal's Ctrl-C) so that the server can drain first; and if the engine
process dies, a stream in flight ends with an error event and [DONE], and later requests get a
503 error body at once instead of hanging; an engine process that does not stop when told is
killed (it ignores SIGTERM, so terminating it would leave it running)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from openai import OpenAI

from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from kipp_core.server.engine_process import EngineProcess
from tests.server.conftest import kipp_serve, sse_events


def serve(*args: str):
    return kipp_serve(*args)


BODY = {"prompt": "process", "max_tokens": 300, "ignore_eos": True, "temperature": 0}


async def _stream(url) -> tuple[bool, list]:
    async with aiohttp.ClientSession() as s:
        return await sse_events(s, url, BODY)


def _status(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_served_tokens_equal_offline():
    proc, url, _ = serve()
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        r = client.completions.create(
            model="kipp-tiny", prompt="Hello there", max_tokens=12, temperature=0
        )
        c = client.chat.completions.create(
            model="kipp-tiny",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            temperature=0,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    llm = LLM("kipp-tiny", backend="oracle")
    want = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=12))[0]
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 12
    assert c.usage.completion_tokens == 8 and proc.returncode == 0


def test_a_group_signal_drains_before_the_engine_stops():
    proc, url, _ = serve("--shutdown-timeout", "60")

    async def run():
        task = asyncio.ensure_future(_stream(url))
        await asyncio.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # every process of the group, as Ctrl-C does
        return await task

    done, events = asyncio.run(run())
    assert proc.wait(90) == 0
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"


def test_a_dead_engine_fails_streams_and_later_requests_cleanly():
    proc, url, engine_pid = serve()
    try:

        async def run():
            task = asyncio.ensure_future(_stream(url))
            await asyncio.sleep(1.0)
            os.kill(engine_pid, signal.SIGKILL)
            return await asyncio.wait_for(task, 30)

        done, events = asyncio.run(run())
        assert done and "error" in events[-1]  # a final error event, then [DONE]
        status, body = _status(url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and "exited" in body["error"]["message"]
        assert _status(url, "/health")[0] == 503
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.mark.parametrize("flag", ["--engine-in-process"])
def test_the_engine_can_stay_in_process(flag):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kipp_core.cli.main", "serve", "--model", "kipp-tiny"]
    proc = subprocess.Popen(
        [*cmd, "--backend", "oracle", "--port", str(port), flag],
        env=dict(os.environ),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            line = proc.stderr.readline()
            assert "engine process" not in line
            if "ready" in line or time.monotonic() > deadline:
                break
        status, body = _status(f"http://127.0.0.1:{port}", "/v1/completions", {"prompt": "x"})
        assert status == 200 and body["usage"]["completion_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _stuck_child(model, llm_kwargs, cmd_conn, msg_conn, log_level):
    """An engine process that loads, then never reads a command, ignoring SIGTERM as _child."""
    import pickle

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    msg_conn.send_bytes(pickle.dumps(("ready", {})))
    time.sleep(600)


def test_an_engine_process_that_does_not_stop_is_killed():
    ep = EngineProcess("unused", {}, child=_stuck_child)
    ep.launch()
    ep.start(lambda msg: None)
    t = time.monotonic()
    ep.stop(timeout=0.5)
    assert not ep._proc.is_alive()
    assert ep._proc.exitcode == -signal.SIGKILL
    assert time.monotonic() - t < 10
