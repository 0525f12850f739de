"""A fake OpenAI-compatible streaming server with known timings, for the load generator's tests.

A request's token k (0-based) is written at arrival + FIRST_S + k * GAP_S, on an absolute
schedule (each sleep aims at that time, so late wake-ups do not add up), one token a chunk. After
the last token: a finish-only chunk with no text (as llama-server ends a stream), the usage chunk
unless the prompt asks for none, then [DONE]. A first prompt id in MODES picks a behaviour (ids
of random workloads stay below them with --vocab 1000); any other prompt is served normally.
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

FIRST_S = 0.1  # arrival to the first token
GAP_S = 0.02  # between tokens
MODES = {"no_usage": 1001, "http_429": 1002, "error_event": 1003, "drop": 1004, "split": 1005}
FAIL_AT = 2  # the token index at which error_event / drop happen


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _completions(request: web.Request) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    body = await request.json()
    t0 = loop.time()
    chat = request.path.endswith("/chat/completions")
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    mode = prompt[0] if isinstance(prompt, list) and prompt else None
    if mode == MODES["http_429"]:
        return web.json_response({"error": {"message": "slow down", "code": 429}}, status=429)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if chat:  # the role chunk comes at once and carries no token
        await resp.write(_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    n = body["max_tokens"]
    for k in range(n):
        await asyncio.sleep(max(0.0, t0 + FIRST_S + k * GAP_S - loop.time()))
        if k == FAIL_AT and mode == MODES["error_event"]:
            await resp.write(_event({"error": {"message": "engine failed", "code": 500}}))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        if k == FAIL_AT and mode == MODES["drop"]:
            request.transport.close()
            return resp
        choice = {"index": 0, "delta": {"content": f" t{k}"}} if chat else {"text": f" t{k}"}
        ev = _event({"choices": [{**choice, "finish_reason": None}]})
        if mode == MODES["split"]:  # the event in two network writes, cut inside the JSON
            await resp.write(ev[:20])
            await asyncio.sleep(0.002)
            ev = ev[20:]
        await resp.write(ev)
    fin = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
    await resp.write(_event({"choices": [{**fin, "finish_reason": "length"}]}))
    if mode != MODES["no_usage"] and body.get("stream_options", {}).get("include_usage"):
        plen = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        usage = {"prompt_tokens": plen, "completion_tokens": n, "total_tokens": plen + n}
        await resp.write(_event({"choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


class FakeServer:
    """The fake server on its own loop in a daemon thread; `url` once started."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", _completions)
        app.router.add_post("/v1/chat/completions", _completions)
        app.router.add_get("/v1/models", _models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def start(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
