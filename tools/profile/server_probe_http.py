"""tools/profile/server_probe.py's server under test (a `kipp serve` subprocess, its RSS and /health
latency sampled), a streamed completion, the small HTTP-layer checks on raw sockets, and SIGTERM
with requests in flight."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Server:
    """`kipp serve` in a subprocess on a free port, its RSS and /health latency sampled."""

    def __init__(self, tree: str, backend: str, extra: list[str], env: dict | None = None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kipp_core.cli.main", "serve", "--model", "kipp-tiny"]
        cmd += ["--backend", backend, "--port", str(self.port), *extra]
        e = {**os.environ, "PYTHONPATH": tree, **(env or {})}
        self.proc = subprocess.Popen(
            cmd, cwd=tree, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.stderr = []
        threading.Thread(target=self._drain, daemon=True).start()
        self.peak_rss = self.overall_peak = 0.0
        self.max_health_ms = 0.0
        self._stop = threading.Event()

    def _drain(self):
        for line in self.proc.stderr:
            self.stderr.append(line.decode(errors="replace"))

    def wait_ready(self, timeout: float = 300) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.2)
        else:
            raise RuntimeError("server did not come up: " + "".join(self.stderr[-5:]))
        self.idle_rss = rss_mb(self.proc.pid)
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self):
        import urllib.request

        while not self._stop.is_set() and self.proc.poll() is None:
            try:
                self.peak_rss = max(self.peak_rss, rss_mb(self.proc.pid))
                self.overall_peak = max(self.overall_peak, self.peak_rss)
                t = time.perf_counter()
                with urllib.request.urlopen(self.url + "/health", timeout=30):
                    pass
                self.max_health_ms = max(self.max_health_ms, (time.perf_counter() - t) * 1e3)
            except Exception:
                pass
            time.sleep(0.05)

    def reset_peaks(self):
        self.peak_rss = rss_mb(self.proc.pid)
        self.max_health_ms = 0.0

    def kv_used(self) -> float:
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("kipp_kv_blocks_used "):
                    return float(line.split()[1])
        return -1.0

    def stop(self):
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


async def stream_tokens(session, url, body, timeout=600) -> dict:
    """A streamed completion: its token text per choice, whether [DONE] came, any error event."""
    out = {"status": None, "text": {}, "done": False, "error": None}
    try:
        async with session.post(
            url + "/v1/completions",
            json={**body, "stream": True},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as r:
            out["status"] = r.status
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    out["done"] = True
                elif line.startswith(b"data: "):
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        out["error"] = ev["error"]["message"]
                    for c in ev.get("choices", []):
                        out["text"][c["index"]] = out["text"].get(c["index"], "") + c["text"]
    except Exception as e:  # a cut stream
        out["error"] = out["error"] or f"{type(e).__name__}: {e}"
    return out


def raw(srv: Server, data: bytes, read_s: float = 20.0) -> bytes:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=read_s)
    s.sendall(data)
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out:
                head, _, rest = out.partition(b"\r\n\r\n")
                length = [
                    int(h.split(b":")[1])
                    for h in head.split(b"\r\n")
                    if h.lower().startswith(b"content-length:")
                ]
                if length and len(rest) >= length[0]:
                    break
                if head.startswith(b"HTTP/1.1 100"):
                    break
    except OSError:
        pass
    s.close()
    return out


def summary(resp: bytes) -> str:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    ctype = next((h for h in lines if h.lower().startswith(b"content-type")), b"")
    return f"{lines[0].decode(errors='replace')} | {ctype.decode()} | {body[:80]!r}"


def probe_small(srv: Server, key_srv: Server) -> dict:
    """`key_srv` has an API key and --max-waiting 8."""

    def req(body: bytes, headers: dict, path="/v1/completions", target=srv, wait=20.0) -> bytes:
        h = {"Host": "127.0.0.1", "Content-Length": str(len(body)), **headers}
        head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items())
        return raw(target, head.encode() + b"\r\n" + body, wait)

    js = {"Content-Type": "application/json"}
    auth = {**js, "Authorization": "Bearer probe-key"}
    one = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    out = {}
    out["gzip_garbage"] = summary(req(b"not gzip", {**js, "Content-Encoding": "gzip"}))
    out["n_over_max_waiting"] = summary(
        req(json.dumps({"prompt": "x", "n": 16}).encode(), auth, target=key_srv)
    )
    t = time.perf_counter()
    chat = {"messages": [{"role": "user", "content": "x"}], "min_tokens": 10**9}
    out["min_tokens_1e9"] = summary(req(json.dumps(chat).encode(), js, "/v1/chat/completions"))
    out["min_tokens_1e9_s"] = round(time.perf_counter() - t, 1)
    out["parser_error"] = summary(raw(srv, b"GET /\x01bad HTTP/1.1\r\nHost: x\r\n\r\n"))
    r = raw(srv, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    out["server_header"] = next(
        (h.decode() for h in r.split(b"\r\n") if h.lower().startswith(b"server:")), None
    )
    out["expect_100_over_limit"] = summary(
        req(b"", {**js, "Content-Length": "999999999", "Expect": "100-continue"}, wait=3.0)
    )
    out["foreign_host_no_key"] = summary(req(one, {**js, "Host": "evil.example"}))
    out["text_plain_body"] = summary(req(one, {"Content-Type": "text/plain"}))
    lower = {**js, "Authorization": "bearer probe-key"}
    out["lowercase_bearer"] = summary(req(one, lower, target=key_srv))
    return out


async def probe_sigterm(tree: str, backend: str) -> dict:
    srv = Server(tree, backend, ["--max-waiting", "64"])
    srv.wait_ready()
    body = {"prompt": "drain", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    results = {"stream": [], "plain": []}
    async with aiohttp.ClientSession() as s:

        async def plain():
            try:
                async with s.post(
                    srv.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)
                ) as r:
                    data = await r.read()
                    return f"{r.status} {len(data)} bytes"
            except Exception as e:
                return f"{type(e).__name__}"

        tasks = [asyncio.ensure_future(stream_tokens(s, srv.url, body)) for _ in range(4)]
        ptasks = [asyncio.ensure_future(plain()) for _ in range(2)]
        await asyncio.sleep(1.0)
        srv.proc.send_signal(signal.SIGTERM)
        for t in tasks:
            r = await t
            results["stream"].append(
                "done"
                if r["done"] and not r["error"]
                else f"error event: {r['error']}"
                if r["done"]
                else f"cut: {r['error']}"
            )
        for t in ptasks:
            results["plain"].append(await t)
    rc = srv.proc.wait(60)
    srv.stop()
    results["exit_code"] = rc
    return results
