"""A client process: one share of a run's requests on its own asyncio loop.

Protocol with the parent over a socket (multiprocessing Connection framing): the child receives
(LoadSpec, Share), builds its request bodies, runs its warm-up requests, sends ("ready",),
receives the run's start as wall-clock seconds (shared by every client process), sends its
requests on schedule, and answers ("done", packed records and its CPU seconds) or
("error", message). Meanwhile it
sends ("progress", finished requests) every PROGRESS_S, for the parent's progress bar.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from kipp_core.loadgen.client import Record, stream_request
from kipp_core.loadgen.spec import LoadSpec, request_body

PROGRESS_S = 0.2


@dataclass
class Share:
    """The requests one client process sends: global indices, prompts, output lengths, each
    one's send time in seconds from the start (None: as soon as a slot is free)."""

    indices: list[int]
    prompts: list
    max_tokens: list[int]
    arrivals: list[float] | None
    concurrency: int | None
    warmup: list = field(default_factory=list)  # (prompt, max_tokens) sent before the start


def _session(spec: LoadSpec, limit: int):
    import aiohttp

    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else None
    # Idle keep-alive connections close on this side first (servers close after ~5 s), so that a
    # sparse Poisson run never posts onto a connection the server is closing.
    conn = aiohttp.TCPConnector(limit=limit, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=spec.request_timeout)
    return aiohttp.ClientSession(connector=conn, timeout=timeout, headers=headers)


async def _send_all(session, spec, bodies, share: Share, start: float, done: list) -> list[Record]:
    url, chat = spec.target, spec.chat
    records = [Record(i) for i in share.indices]

    async def one(k: int) -> None:
        await stream_request(session, url, bodies[k], chat, records[k])
        done[0] += 1

    if share.arrivals is None:  # a fixed number of workers, each sending back to back
        n = len(bodies) if share.concurrency is None else min(share.concurrency, len(bodies))
        it = iter(range(len(bodies)))

        async def worker():
            for k in it:
                await one(k)

        await asyncio.gather(*(worker() for _ in range(n)))
        return records
    gate = asyncio.Semaphore(share.concurrency) if share.concurrency else None

    async def timed(k: int) -> None:
        delay = start + share.arrivals[k] - perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            await one(k)
        else:
            async with gate:
                await one(k)

    await asyncio.gather(*(timed(k) for k in range(len(bodies))))
    return records


async def _warmup(session, spec: LoadSpec, share: Share) -> None:
    bodies = [request_body(spec, -1 - i, p, m) for i, (p, m) in enumerate(share.warmup)]
    recs = await asyncio.gather(
        *(stream_request(session, spec.target, b, spec.chat, Record(-1)) for b in bodies)
    )
    bad = [r for r in recs if not r.ok]
    if bad:
        raise RuntimeError(f"a warm-up request failed ({bad[0].status}): {bad[0].error}")


async def _report(conn, done: list) -> None:
    sent = 0
    while True:
        await asyncio.sleep(PROGRESS_S)
        if done[0] != sent:
            sent = done[0]
            conn.send(("progress", sent))


async def _main(conn, spec: LoadSpec, share: Share) -> tuple[list[Record], float, float]:
    bodies = [
        request_body(spec, i, p, m)
        for i, p, m in zip(share.indices, share.prompts, share.max_tokens)
    ]
    async with _session(spec, limit=0) as session:
        await _warmup(session, spec, share)
        conn.send(("ready",))
        start_wall = conn.recv()
        start = perf_counter() + (start_wall - time.time())
        delay = start - perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        done = [0]
        reporter = asyncio.ensure_future(_report(conn, done))
        cpu = time.process_time()
        try:
            records = await _send_all(session, spec, bodies, share, start, done)
        finally:
            reporter.cancel()
        cpu = time.process_time() - cpu
    return records, start, cpu


def pack(records: list[Record], start: float) -> dict:
    """Records as arrays, times in seconds from the start; the gaps between token events of
    every request concatenated in `itl` (request k's are its `chunks - 1` entries)."""
    nan = float("nan")
    first = [r.times[0] - r.sent if r.times else nan for r in records]
    return {
        "index": np.array([r.index for r in records], dtype=np.int64),
        "sent": np.array([r.sent - start for r in records]),
        "done": np.array([r.done - start for r in records]),
        "ttft": np.array(first),
        "status": np.array([r.status for r in records], dtype=np.int64),
        "error": [r.error for r in records],
        "prompt_tokens": np.array(
            [-1 if r.prompt_tokens is None else r.prompt_tokens for r in records], dtype=np.int64
        ),
        "output_tokens": np.array(
            [-1 if r.output_tokens is None else r.output_tokens for r in records], dtype=np.int64
        ),
        "chunks": np.array([len(r.times) for r in records], dtype=np.int64),
        "itl": np.concatenate([np.diff(r.times) for r in records if r.times] or [np.zeros(0)]),
        "itl_owner": np.concatenate(
            [np.full(len(r.times) - 1, r.index) for r in records if r.times]
            or [np.zeros(0, dtype=np.int64)]
        ).astype(np.int64),
    }


def client_process(conn) -> None:
    """The child's entry point (python -m kipp_core.loadgen FD, started by the runner)."""
    try:
        spec, share = conn.recv()
        records, start, cpu = asyncio.run(_main(conn, spec, share))
        conn.send(("done", {**pack(records, start), "cpu_s": np.array([cpu])}))
    except BaseException as e:  # the parent reports it as one line
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()
