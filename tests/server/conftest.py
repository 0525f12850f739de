"""Servers for the server tests: real aiohttp servers on 127.0.0.1 over kipp-tiny on the oracle.

`ScriptedBackend` forces what the random-weight model writes, for the reasoning and tool-call
paths: a sequence whose prompt holds `[[script:NAME]]` emits the tokens of SCRIPTS[NAME] (the real
model still runs; only the sampled token is replaced), then <|im_end|>. A prompt holding `[[fail]]`
makes the backend raise, and one holding `[[slow]]` makes every step it runs in take SLOW_STEP_S
longer (a sleep, so the server's event loop runs meanwhile). What this proves is the server's
parsing, streaming and error handling on known text, not anything about the model.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import pytest

from kipp_core.llm import LLM
from kipp_core.registry import IM_END_ID
from kipp_core.server.context import ServerConfig
from kipp_core.server.server import APIServer, ServerThread

SCRIPTS = {
    "think_call": (
        "<think>\nThe user wants the weather.\n</think>\n\nLet me check. "
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call>"
    ),
    "two_calls": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    ),
    "think_only": "<think>\nJust thinking.\n</think>\n\nThe answer is 4.",
    # Thinking-2507: its prompt opened the block, so the output closes it only
    "think_opened": "The user asks.\n</think>\n\nThe answer is 4.",
    "bad_call": '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call> done',
}


SLOW_STEP_S = 0.05


class ScriptedBackend:
    def __init__(self, inner, tokenizer):
        self.inner = inner
        self.config = inner.config
        self.block_size = inner.block_size
        self.num_blocks = inner.num_blocks
        self._tok = tokenizer
        self._scripts = {k: tokenizer.encode(v) for k, v in SCRIPTS.items()}
        self._prompts: dict[int, str] = {}

    def _prompt(self, inp) -> str:
        if inp.seq_id not in self._prompts:
            self._prompts[inp.seq_id] = self._tok.decode(inp.sampler.prompt_token_ids)
        return self._prompts[inp.seq_id]

    def execute(self, batch):
        for inp in batch.seqs:
            if inp.sampler is not None and "[[fail]]" in self._prompt(inp):
                raise RuntimeError("injected backend fault")
        if any(inp.sampler is not None and "[[slow]]" in self._prompt(inp) for inp in batch.seqs):
            time.sleep(SLOW_STEP_S)
        outs = self.inner.execute(batch)
        for inp, out in zip(batch.seqs, outs):
            if inp.sampler is None or inp.sampler.allowed is not None:
                continue  # (a structured-outputs mask decides these tokens)
            prompt = self._prompt(inp)
            for name, ids in self._scripts.items():
                if f"[[script:{name}]]" in prompt:
                    step = len(inp.sampler.output_token_ids)
                    out.token_ids = [ids[step] if step < len(ids) else IM_END_ID]
                    out.logprobs = None
        return outs


def with_template(tiny_path, out, template: str):
    """kipp-tiny in folder `out` (weights linked) with `template` as its chat template."""
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny_path.iterdir():
        if f.name == "tokenizer_config.json":
            cfg = json.loads(f.read_text())
            (out / f.name).write_text(json.dumps({**cfg, "chat_template": template}))
        elif f.suffix == ".safetensors":
            (out / f.name).symlink_to(f)
        else:
            (out / f.name).write_bytes(f.read_bytes())
    return out


def start_server(tiny_path, config: ServerConfig | None = None, **llm_kw) -> ServerThread:
    llm = LLM(str(tiny_path), backend="oracle", **llm_kw)
    llm.engine.backend = ScriptedBackend(llm.engine.backend, llm.tokenizer)
    config = config or ServerConfig(port=0)
    return ServerThread(APIServer(config, llm=llm, model_name="kipp-tiny")).start()


def kipp_serve(*args: str, model: str = "kipp-tiny"):
    """`kipp serve` on the oracle in a process of its own, on a free port: (the process, its URL,
    the engine process's pid) once the model is loaded. From then on a thread reads its stderr,
    so that its log never fills the pipe."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kipp_core.cli.main", "serve", "--model", model]
    cmd += ["--backend", "oracle", "--port", str(port), *args]
    proc = subprocess.Popen(
        cmd, env=dict(os.environ), stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines = []
    deadline = time.monotonic() + 120
    while True:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, "the server did not start"
        lines.append(line)
        m = re.search(r"engine process (\d+) loaded", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, f"http://127.0.0.1:{port}", int(m.group(1))


def engine_of(server: ServerThread):
    return server.server.state.ctx.llm.engine


def wait_idle(server: ServerThread, timeout: float = 20.0) -> None:
    """Wait until the engine has no requests, then check that every KV block is free."""
    engine = engine_of(server)
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() or engine.block_manager.num_used_blocks:
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)
    engine.block_manager.check_all_free()


@pytest.fixture(scope="session")
def server(tiny_path):
    st = start_server(tiny_path)
    yield st
    st.stop()


@pytest.fixture(scope="module", name="http")
def http_connection(server):
    """A keep-alive connection to the shared server (named `http` in the tests)."""
    h = Http(server.url)
    yield h
    h.close()


@pytest.fixture(scope="module")
def tok(tiny_path):
    from kipp_core.tokenizer import Tokenizer

    return Tokenizer(tiny_path)


class Http:
    """A keep-alive HTTP/1.1 connection that returns (status, headers, parsed JSON or text)."""

    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)

    def request(self, method: str, path: str, body=None, headers=None):
        if body is not None and not isinstance(body, bytes):
            body = json.dumps(body).encode()
        h = {"Content-Type": "application/json", **(headers or {})}
        try:
            self.conn.request(method, path, body=body, headers=h)
            resp = self.conn.getresponse()
        except (ConnectionError, http.client.HTTPException):
            self.conn.close()  # the server may close a connection after an error: reconnect once
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            self.conn.request(method, path, body=body, headers=h)
            resp = self.conn.getresponse()
        data = resp.read()
        kind = resp.getheader("Content-Type", "")
        parsed = json.loads(data) if kind.startswith("application/json") else data.decode()
        return resp.status, resp.headers, parsed

    def post(self, path: str, body, headers=None):
        return self.request("POST", path, body, headers)

    def get(self, path: str, headers=None):
        return self.request("GET", path, None, headers)

    def close(self):
        self.conn.close()


def assert_error_body(body, status: int | None = None) -> dict:
    """An OpenAI error body: {"error": {message, type, param, code}}, and no traceback."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert "Traceback" not in err["message"] and 'File "' not in err["message"]
    return err


def unread_stream(port: int, body: dict) -> socket.socket:
    """POST /v1/completions with `body` on a socket with a 4 KiB receive window that nothing
    reads (the caller may read it slowly)."""
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
        + f"\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return s


async def sse_events(session, url: str, body: dict) -> tuple[bool, list[dict]]:
    """POST a streaming /v1/completions `body`: (whether [DONE] came, the events before it)."""
    events, done = [], False
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        async for line in r.content:
            if line.startswith(b"data: [DONE]"):
                done = True
            elif line.startswith(b"data: "):
                events.append(json.loads(line[6:]))
    return done, events
