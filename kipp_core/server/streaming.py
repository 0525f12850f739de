"""Server-sent events as OpenAI streams them: `data: {json}` events, then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from kipp_core.server.async_engine import EngineFailure
from kipp_core.server.errors import APIError

DISCONNECTED = web.RequestKey("kipp_disconnected", bool)  # set when a stream's client went away
WRITE_TIMEOUT = web.AppKey("kipp_write_timeout", float)  # seconds; 0: none

log = logging.getLogger("kipp")


class SlowClient(Exception):
    """The client did not take a write within the write timeout."""


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class EventStream:
    """One streaming response. `send` writes a batch of events in one write."""

    def __init__(self, request: web.Request):
        self._request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must not buffer the stream
            },
        )

    async def start(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, events: list[dict]) -> None:
        if events:
            await self._write(b"".join(b"data: " + dumps(e) + b"\n\n" for e in events))

    async def _write(self, data: bytes) -> None:
        # A write waits only when the transport's buffer is full: the client is not reading.
        # asyncio.timeout (3.11) arms one timer; wait_for made a task a write, per token.
        timeout = self._request.app.get(WRITE_TIMEOUT) or None
        try:
            if timeout is None:
                await self.response.write(data)
            elif hasattr(asyncio, "timeout"):
                async with asyncio.timeout(timeout):
                    await self.response.write(data)
            else:
                await asyncio.wait_for(self.response.write(data), timeout)
        except asyncio.TimeoutError:
            raise SlowClient from None

    async def finish(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()


async def stream_response(request: web.Request, stream, first: list[dict], chunks):
    """Send `first`, then `chunks(out, stream)` for each engine output, then [DONE]. An engine
    failure becomes an error event; a client that left only marks the request disconnected (the
    caller's cleanup aborts it)."""
    events = EventStream(request)
    try:
        await events.start()
        await events.send(first)
        async for out in stream:
            await events.send(chunks(out, stream))
        await events.finish()
    except EngineFailure as e:
        await events.send([APIError(500, str(e)).body()])
        await events.finish()
    except SlowClient:
        log.warning("aborting %s: its client took no data for the write timeout", request.path)
        request[DISCONNECTED] = True
        if request.transport is not None:
            request.transport.abort()  # drops what is buffered for it
    except ConnectionResetError:
        request[DISCONNECTED] = True
    return events.response
