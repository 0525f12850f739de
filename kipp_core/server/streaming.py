"""Server-sent events: OpenAI's Chat and Completions streams send `data: {json}` events, then
`data: [DONE]`; Anthropic's and the Responses API's name each event (`event: TYPE`, its data's
"type") and end with their last event."""

from __future__ import annotations

import json
import logging

from aiohttp import web

from kipp_core.server.async_engine import EngineFailure
from kipp_core.server.errors import APIError
from kipp_core.server.write_watch import WriteWatch

DISCONNECTED = web.RequestKey("kipp_disconnected", bool)  # set when a stream's client went away
WRITE_WATCH = web.AppKey("kipp_write_watch", WriteWatch)  # every stream's write timeout

log = logging.getLogger("kipp")


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


class ChunkFrame:
    """The bytes of a stream's plain chunk event, `data: {head..., "choices": [{"index": i,
    <key>: <value>, "logprobs": null, "finish_reason": null}]}` (plus `"usage": null`), with the
    head serialized once a stream: dumps of the whole dict cost ~4 us a token, of the ~29 us
    that the API process spent on a streamed token. `frame(i, value)` equals `data: ` + dumps(the
    dict); EventStream.send takes these bytes beside event dicts."""

    def __init__(self, head: dict, key: str, usage_null: bool):
        self._pre = b"data: " + dumps(head)[:-1] + b',"choices":[{"index":'
        self._key = b',"' + key.encode() + b'":'
        usage = b',"usage":null' if usage_null else b""
        self._post = b',"logprobs":null,"finish_reason":null}]' + usage + b"}\n\n"

    def frame(self, index: int, value) -> bytes:
        return self._pre + str(index).encode() + self._key + dumps(value) + self._post


class EventStream:
    """One streaming response. `send` writes a batch of events in one write; `named` events
    carry an `event:` line and no [DONE] follows them."""

    def __init__(self, request: web.Request, named: bool = False):
        self._request = request
        self.named = named
        self._watch = request.app[WRITE_WATCH]
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

    async def send(self, events: list) -> None:
        """Events as dicts, or (unnamed streams) already framed bytes (ChunkFrame)."""
        if not events:
            return
        if self.named:
            data = b"".join(
                b"event: " + e["type"].encode() + b"\ndata: " + dumps(e) + b"\n\n" for e in events
            )
        else:
            data = b"".join(
                e if isinstance(e, bytes) else b"data: " + dumps(e) + b"\n\n" for e in events
            )
        await self._write(data)

    async def _write(self, data: bytes) -> None:
        await self._watched(self.response.write(data))

    async def _watched(self, write) -> None:
        self._watch.began(self, self._too_slow)
        try:
            await write
        finally:
            self._watch.ended(self)

    def _too_slow(self) -> None:
        """The watch's verdict: the write has waited past the timeout; the connection goes (the
        handler is cancelled or its write raises, and the request is aborted)."""
        request = self._request
        log.warning("aborting %s: its client took no data for the write timeout", request.path)
        request[DISCONNECTED] = True
        if request.transport is not None:
            request.transport.abort()  # drops what is buffered; the write raises

    async def finish(self) -> None:
        if not self.named:
            await self._write(b"data: [DONE]\n\n")
        await self._watched(self.response.write_eof())


def openai_error(message: str) -> list[dict]:
    return [APIError(500, message).body()]


async def stream_response(
    request: web.Request, stream, first: list[dict], chunks, named=False, failed=openai_error
):
    """Send `first`, then `chunks(out, stream)` for each engine output, then [DONE] (unless the
    events are `named`). An engine failure becomes the events `failed(message)` makes; a client
    that left only marks the request disconnected (the caller's cleanup aborts it)."""
    events = EventStream(request, named)
    try:
        await events.start()
        await events.send(first)
        async for out in stream:
            await events.send(chunks(out, stream))
        await events.finish()
    except EngineFailure as e:
        await events.send(failed(str(e)))
        await events.finish()
    except ConnectionResetError:
        request[DISCONNECTED] = True
    return events.response
