"""The request flow the chat front ends share (Chat Completions, Messages, Responses): read the
body, translate it into a ChatRequest off the event loop (kipp_core/server/chat_spec.py), compile
its schemas, queue it, and answer with the whole body or a stream of the front end's events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from kipp_core.outputs import RequestOutput
from kipp_core.server.access_log import ACCESS, STREAM
from kipp_core.server.async_engine import EngineRequest, RequestStream
from kipp_core.server.body import read_json
from kipp_core.server.chat_spec import ChatRequest, check_structured
from kipp_core.server.context import STATE, ServingContext
from kipp_core.server.streaming import dumps, stream_response


class ChatResponse(Protocol):
    """A front end's answer to one request: its body, or its stream's events."""

    named: bool  # server-sent events named by their type (no [DONE])

    def body(self, final: RequestOutput) -> dict: ...

    def first_events(self) -> list[dict]: ...

    def events(self, out: RequestOutput, stream: RequestStream) -> list[dict]: ...

    def failed(self, message: str) -> list[dict]: ...


def json_response(body: dict) -> web.Response:
    return web.Response(body=dumps(body), content_type="application/json")


async def serve_chat(
    request: web.Request,
    parse: Callable[[dict, ServingContext], ChatRequest],
    id_prefix: str,
    make_response: Callable[[ChatRequest, ServingContext, str], ChatResponse],
) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    ctx = state.ready()
    body = await read_json(request)
    # Off the event loop: rendering a long chat and tokenizing it take a while (offload.py)
    req = await asyncio.get_running_loop().run_in_executor(None, parse, body, ctx)
    rid = ctx.new_id(id_prefix)
    request[ACCESS] = rid
    item = EngineRequest(rid, req.prompt_token_ids, req.params, req.prompt)
    response = make_response(req, ctx, rid)
    await check_structured(req)
    stream = request[STREAM] = await ctx.submit([item], arrival, state.config.retry_after_s)
    try:
        if not req.stream:
            return json_response(response.body((await stream.collect())[0]))
        return await stream_response(
            request,
            stream,
            response.first_events(),
            response.events,
            response.named,
            response.failed,
        )
    finally:
        stream.close()
