"""64 concurrent streaming clients on loopback, a quarter of them disconnecting at random points:
no 5xx, every other request complete, continuous batching seen, and every KV block free after."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import Http, engine_of, wait_idle

NUM_CLIENTS = 64
MAX_TOKENS = 8


async def _client(session, url: str, i: int, drop_after: int | None) -> dict:
    body = {
        "prompt": f"client {i} says" + " hello" * (i % 7),
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = {"status": None, "text": "", "finish": None, "usage": None, "done": False}
    async with session.post(url, json=body) as resp:
        out["status"] = resp.status
        events = 0
        async for line in resp.content:
            if drop_after is not None and events >= drop_after:
                resp.close()  # drop the connection mid-stream
                out["dropped"] = True
                return out
            if line.startswith(b"data: [DONE]"):
                out["done"] = True
            elif line.startswith(b"data: "):
                events += 1
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    out["text"] += c["text"]
                    out["finish"] = c["finish_reason"] or out["finish"]
                out["usage"] = chunk.get("usage") or out["usage"]
    return out


async def _run(server) -> tuple[list[dict], int]:
    rng = random.Random(0)
    engine = engine_of(server)
    peak = 0

    async def monitor():
        nonlocal peak
        while True:
            peak = max(peak, len(engine.scheduler.running))
            await asyncio.sleep(0.002)

    url = server.url + "/v1/completions"
    drops = [rng.randint(0, MAX_TOKENS - 1) if i % 4 == 0 else None for i in range(NUM_CLIENTS)]
    watcher = asyncio.ensure_future(monitor())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        results = await asyncio.gather(*(_client(session, url, i, d) for i, d in enumerate(drops)))
    watcher.cancel()
    return results, peak


def _server_errors(server) -> float:
    _, _, text = Http(server.url).get("/metrics")
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "kipp_requests_total" and s.labels["status"].startswith("5")
    )


def test_64_streams_with_random_disconnects(server):
    errors_before = _server_errors(server)  # the shared server fixture may have failed on purpose
    results, peak = asyncio.run(_run(server))
    assert all(r["status"] == 200 for r in results)
    dropped = [r for r in results if r.get("dropped")]
    complete = [r for r in results if not r.get("dropped")]
    assert len(dropped) == NUM_CLIENTS // 4
    for r in complete:
        assert r["done"] and r["finish"] == "length" and r["text"]
        assert r["usage"]["completion_tokens"] == MAX_TOKENS
    assert peak >= 32  # the requests ran batched together, not one after another
    wait_idle(server)  # every aborted request freed its blocks
    assert _server_errors(server) == errors_before
    _, _, text = Http(server.url).get("/metrics")
    assert "kipp_kv_blocks_used 0.0" in text and "kipp_num_requests_running 0.0" in text
