"""A reliability probe of `kipp serve`: extreme-but-valid sampling bodies beside greedy streams,
a client that never reads, prompt logprobs on a long prompt, stalled bodies, a big `n` beside a
small stream, slow and fast clients, a huge body beside a small request, SIGTERM in flight, and the
small HTTP-layer checks. It starts the server as a subprocess (from `--tree`, default this
checkout) and prints one JSON object: per probe what was tried and what came back, the server's
peak RSS and the longest /health answer seen meanwhile (an event-loop freeze).

    python tools/profile/server_probe.py --backend oracle [--tree /tmp/base] [--only a,b]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip  # noqa: F401 (the garbage body is deliberately not gzip)
import json
import random
import socket
import threading
import time
from pathlib import Path

import aiohttp
from server_probe_http import Server, probe_sigterm, probe_small, rss_mb, stream_tokens

ROOT = Path(__file__).resolve().parents[2]  # the checkout (tools/profile/ is two below)


def extreme_body(rng: random.Random) -> dict:
    tiny = [0.0, 5e-324, 1e-300, 1e-45, 7e-46, 1e-40, 1e-38, 1e-20, 1e-6]
    big = [1e300, 1e308, 1e38, 3.5e38, 1e39, 1e10, 100.0]
    body = {"prompt": "probe", "max_tokens": rng.choice([1, 2, 4]), "seed": rng.randrange(1000)}
    pick = rng.random
    body["temperature"] = rng.choice(tiny + big + [0.7, 1.0, 1e-5])
    if pick() < 0.7:
        body["top_p"] = rng.choice([t for t in tiny if t > 0] + [1.0, 0.5, 1 - 1e-12])
    if pick() < 0.5:
        body["repetition_penalty"] = rng.choice([t for t in tiny if t > 0] + big + [1.0])
    if pick() < 0.4:
        body["min_p"] = rng.choice([0.0, 1e-45, 1.0, 0.999999])
    if pick() < 0.4:
        body["top_k"] = rng.choice([-1, 0, 1, 2, 10**9])
    if pick() < 0.4:
        body["presence_penalty"] = rng.choice([-2.0, 2.0, 0.0])
        body["frequency_penalty"] = rng.choice([-2.0, 2.0, 0.0])
    if pick() < 0.3:
        body["logit_bias"] = {str(rng.randrange(151643)): rng.choice([-100, 100])}
    if pick() < 0.3:
        body["min_tokens"] = body["max_tokens"]
    if pick() < 0.2:
        body["logprobs"] = rng.choice([0, 5, 20])
    return body


async def probe_extreme(srv: Server, n_bodies: int) -> dict:
    streams = [
        {"prompt": f"stream {i}", "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        for i in range(8)
    ]
    async with aiohttp.ClientSession() as s:
        alone = [await stream_tokens(s, srv.url, b) for b in streams]
        srv.reset_peaks()
        rng = random.Random(0)
        statuses: dict[int, int] = {}
        errors = []

        async def bodies():
            sem = asyncio.Semaphore(8)

            async def one(b):
                async with sem:
                    try:
                        async with s.post(srv.url + "/v1/completions", json=b) as r:
                            statuses[r.status] = statuses.get(r.status, 0) + 1
                            if r.status >= 500:
                                errors.append((b, (await r.text())[:200]))
                    except Exception as e:
                        statuses[-1] = statuses.get(-1, 0) + 1
                        errors.append((b, repr(e)))

            await asyncio.gather(*(one(extreme_body(rng)) for _ in range(n_bodies)))

        got = await asyncio.gather(*(stream_tokens(s, srv.url, b) for b in streams), bodies())
    got = got[:8]
    broken = sum(not g["done"] or g["error"] is not None for g in got)
    wrong = sum(g["text"] != a["text"] for g, a in zip(got, alone))
    return {
        "bodies": n_bodies,
        "statuses": statuses,
        "5xx": sum(v for k, v in statuses.items() if k >= 500 or k < 0),
        "streams_broken": broken,
        "streams_wrong_tokens": wrong,
        "first_5xx": errors[:3],
        "peak_rss_mb": round(srv.peak_rss, 1),
        "max_health_ms": round(srv.max_health_ms, 1),
    }


def probe_nonreader(srv: Server, n: int, max_tokens: int, watch_s: float) -> dict:
    srv.reset_peaks()
    base = rss_mb(srv.proc.pid)
    body = json.dumps(
        {
            "prompt": "never read",
            "n": n,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "logprobs": 5,  # large events: the kernel's socket buffers fill within seconds
            "stream": True,
        }
    ).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", srv.port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    t0 = time.monotonic()
    freed_at = None
    seen_busy = False
    while time.monotonic() - t0 < watch_s:
        time.sleep(1.0)
        used = srv.kv_used()
        seen_busy |= used > 0
        if seen_busy and used == 0 and freed_at is None:
            freed_at = time.monotonic() - t0
            break
    s.close()
    return {
        "n": n,
        "max_tokens": max_tokens,
        "idle_rss_mb": round(base, 1),
        "rss_growth_mb": round(srv.peak_rss - base, 1),
        "aborted_after_s": None if freed_at is None else round(freed_at, 1),
        "watched_s": watch_s,
    }


async def probe_prompt_logprobs(srv: Server, n_tokens: int) -> dict:
    srv.reset_peaks()
    base = rss_mb(srv.proc.pid)
    rng = random.Random(1)
    prompt = [rng.randrange(1000, 100000) for _ in range(n_tokens)]
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1}
    peak = base
    async with aiohttp.ClientSession() as s:
        task = asyncio.ensure_future(s.post(srv.url + "/v1/completions", json=body))
        while not task.done():
            peak = max(peak, rss_mb(srv.proc.pid))
            await asyncio.sleep(0.02)
        r = task.result()
        status = r.status
        r.release()
    return {"prompt_tokens": n_tokens, "status": status, "rss_growth_mb": round(peak - base, 1)}


def probe_stalled_bodies(srv: Server, count: int, wait_s: float) -> dict:
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"pro'
        )
        socks.append(s)
    time.sleep(wait_s)
    still_open = 0
    for s in socks:
        s.setblocking(False)
        try:
            data = s.recv(4096)
            still_open += data == b"" and 0
        except BlockingIOError:
            still_open += 1
        except OSError:
            pass
        s.close()
    return {"stalled": count, "waited_s": wait_s, "still_open": still_open}


async def timed_stream(s, url, body, timeout=600) -> float:
    t = time.perf_counter()
    r = await stream_tokens(s, url, body, timeout)
    if not r["done"]:
        return float("nan")
    return time.perf_counter() - t


async def probe_fairness(srv: Server, n: int, victim_tokens: int) -> dict:
    victim = {
        "prompt": "victim",
        "max_tokens": victim_tokens,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": 3,
    }
    big = {
        "prompt": "big request",
        "n": n,
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": 4,
    }
    async with aiohttp.ClientSession() as s:
        await timed_stream(s, srv.url, victim)  # warm: the first request pays one-time costs
        alone = min([await timed_stream(s, srv.url, victim) for _ in range(3)])
        big_task = asyncio.ensure_future(stream_tokens(s, srv.url, big, timeout=120))
        await asyncio.sleep(1.0)
        try:
            beside = await asyncio.wait_for(timed_stream(s, srv.url, victim), 120)
        except asyncio.TimeoutError:
            beside = float("inf")
        big_task.cancel()
    await asyncio.sleep(1.0)
    return {
        "n": n,
        "victim_tokens": victim_tokens,
        "alone_s": round(alone, 3),
        "beside_s": round(beside, 3),
        "ratio": round(beside / alone, 1),
    }


async def probe_slow_client(srv: Server, fast: int) -> dict:
    body = {"prompt": "fast", "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    async with aiohttp.ClientSession() as s:
        t = time.perf_counter()
        await asyncio.gather(*(timed_stream(s, srv.url, body) for _ in range(fast)))
        alone = time.perf_counter() - t
        slow = socket.socket()
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", srv.port))
        sb = json.dumps(
            {"prompt": "slow", "n": 4, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        ).encode()
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(sb)}\r\n\r\n".encode()
            + sb
        )
        stop = threading.Event()

        def trickle():
            while not stop.is_set():
                try:
                    slow.recv(1)
                except OSError:
                    return
                time.sleep(1.0)

        threading.Thread(target=trickle, daemon=True).start()
        await asyncio.sleep(1.0)
        t = time.perf_counter()
        await asyncio.gather(*(timed_stream(s, srv.url, body) for _ in range(fast)))
        beside = time.perf_counter() - t
        stop.set()
        slow.close()
    return {"fast": fast, "alone_s": round(alone, 3), "beside_slow_s": round(beside, 3)}


async def probe_huge_body(srv: Server, mb: float) -> dict:
    small = {"prompt": "small", "max_tokens": 1, "temperature": 0}
    words = ("hello world " * int(mb * (1 << 20) / 12))[: int(mb * (1 << 20)) - 64]
    huge = {"prompt": words, "max_tokens": 1}
    async with aiohttp.ClientSession() as s:

        async def small_latency():
            t = time.perf_counter()
            async with s.post(srv.url + "/v1/completions", json=small) as r:
                await r.read()
            return time.perf_counter() - t

        alone = min([await small_latency() for _ in range(3)])
        huge_task = asyncio.ensure_future(s.post(srv.url + "/v1/completions", json=huge))
        await asyncio.sleep(0.5)  # the body is being read or tokenized
        lat = [await small_latency() for _ in range(3)]
        r = await huge_task
        status = r.status
        r.release()
    return {
        "body_mb": mb,
        "huge_status": status,
        "small_alone_ms": round(alone * 1e3, 1),
        "small_beside_ms_max": round(max(lat) * 1e3, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="oracle")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout whose server is probed")
    ap.add_argument("--only", default="", help="comma list of probes")
    ap.add_argument("--bodies", type=int, default=300)
    ap.add_argument("--watch", type=float, default=240.0, help="seconds to watch the nonreader")
    ap.add_argument("--fairness-n", type=int, help="the big request's n (32 on cuda, else 128)")
    a = ap.parse_args()
    only = set(filter(None, a.only.split(",")))
    want = lambda name: not only or name in only  # noqa: E731
    cuda = a.backend == "cuda"
    report: dict = {"backend": a.backend, "tree": a.tree}
    srv = Server(a.tree, a.backend, [])
    try:
        srv.wait_ready()
        report["idle_rss_mb"] = round(srv.idle_rss, 1)
        if want("extreme"):
            report["extreme"] = asyncio.run(probe_extreme(srv, a.bodies))
        if want("small"):
            key = Server(a.tree, a.backend, ["--api-key", "probe-key", "--max-waiting", "8"])
            key.wait_ready()
            report["small"] = probe_small(srv, key)
            key.stop()
        if want("prompt_logprobs"):
            report["prompt_logprobs"] = asyncio.run(
                probe_prompt_logprobs(srv, 2000 if cuda else 4000)
            )
        if want("stalled"):
            report["stalled"] = probe_stalled_bodies(srv, 200, 35.0)
        if want("huge_body"):
            report["huge_body"] = asyncio.run(probe_huge_body(srv, 15.0))
        if want("slow_client"):
            report["slow_client"] = asyncio.run(probe_slow_client(srv, 32))
        if want("fairness"):
            n = a.fairness_n or (32 if cuda else 128)
            report["fairness"] = asyncio.run(probe_fairness(srv, n, 20))
        if want("nonreader"):
            report["nonreader"] = probe_nonreader(srv, 16, 1000 if cuda else 2000, a.watch)
        report["peak_rss_mb"] = round(srv.overall_peak, 1)
    finally:
        srv.stop()
    if want("sigterm"):
        report["sigterm"] = asyncio.run(probe_sigterm(a.tree, a.backend))
    print(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
