"""POST /v1/chat/completions: reasoning split into `reasoning_content`, `<tool_call>` blocks
parsed into `tool_calls`, whole (split_reasoning, parse_tool_calls) or as deltas (ReasoningStream,
ToolCallStream), which give the same result by construction."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from kipp_core.server.access_log import ACCESS, STREAM
from kipp_core.server.async_engine import EngineRequest, RequestStream
from kipp_core.server.body import read_json
from kipp_core.server.chat_request import ChatRequest, check_structured, parse_request
from kipp_core.server.context import STATE, ServingContext
from kipp_core.server.logprobs import chat_logprobs
from kipp_core.server.reasoning import ReasoningStream, split_reasoning
from kipp_core.server.streaming import dumps, stream_response
from kipp_core.server.tool_parser import (
    ToolCallDelta,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
)
from kipp_core.server.usage import timings, usage


def message(req: ChatRequest, text: str) -> tuple[dict, bool]:
    """The assistant message of a whole output, and whether it called tools."""
    reasoning, content = split_reasoning(text, req.thinking, req.think_opened)
    calls = []
    if req.parse_tools:
        content, calls = parse_tool_calls(req.tool_prefix + content)
    msg = {"role": "assistant", "content": content}
    if req.thinking:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return msg, bool(calls)


class DeltaParser:
    """One choice's text deltas as OpenAI chat deltas: reasoning, content and tool calls."""

    def __init__(self, req: ChatRequest):
        self._reasoning = ReasoningStream(req.thinking, req.think_opened)
        self._tools = ToolCallStream() if req.parse_tools else None
        self.called_tools = False
        self._held: list[dict] = []
        if self._tools is not None and req.tool_prefix:
            self._held = self._tool_deltas(self._tools.feed(req.tool_prefix))

    def feed(self, text: str) -> list[dict]:
        out, self._held = self._held, []
        return out + self._split(*self._reasoning.feed(text))

    def finish(self) -> list[dict]:
        out, self._held = self._held, []
        out += self._split(*self._reasoning.finish())
        if self._tools is not None:
            out += self._tool_deltas(self._tools.finish())
        return out

    def _split(self, reasoning: str, content: str) -> list[dict]:
        out = [{"reasoning_content": reasoning}] if reasoning else []
        if content and self._tools is not None:
            out += self._tool_deltas(self._tools.feed(content))
        elif content:
            out.append({"content": content})
        return out

    def _tool_deltas(self, deltas) -> list[dict]:
        out = []
        for d in deltas:
            if not isinstance(d, ToolCallDelta):
                out.append({"content": d})
                continue
            self.called_tools = True
            call = {"index": d.index, "function": {"arguments": d.arguments}}
            if d.id is not None:
                call = {
                    "index": d.index,
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments},
                }
            out.append({"tool_calls": [call]})
        return out


class _Response:
    def __init__(self, req: ChatRequest, ctx: ServingContext, request_id: str):
        self.req, self.ctx = req, ctx
        self.id = request_id
        self.created = int(time.time())
        self.parsers = [DeltaParser(req) for _ in range(req.params.n)]
        self.done: set[int] = set()

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.model_name}

    def _logprobs(self, token_ids, logprobs) -> dict | None:
        if self.req.logprobs is None:
            return None
        return chat_logprobs(self.ctx.tokenizer, zip(token_ids, logprobs or []), self.req.logprobs)

    def body(self, final) -> dict:
        choices = []
        for c in final.outputs:
            msg, called = message(self.req, c.text)
            choices.append(
                {
                    "index": c.index,
                    "message": msg,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": "tool_calls" if called else c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        finals = [final]
        return {
            **self._head("chat.completion"),
            "choices": choices,
            "usage": usage(finals),
            "timings": timings(finals),
        }

    def _chunk(self, index: int, delta: dict, finish=None, logprobs=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    def first_chunks(self) -> list[dict]:
        return [
            self._chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.parsers))
        ]

    def chunks(self, out, stream: RequestStream) -> list[dict]:
        events = []
        for c in out.outputs:
            if c.index in self.done:
                continue
            parser = self.parsers[c.index]
            deltas = parser.feed(c.text_delta)
            if c.finished:
                deltas += parser.finish()
            mine = [self._chunk(c.index, d) for d in deltas]
            lp = self._logprobs(c.token_ids_delta, c.logprobs_delta) if c.token_ids_delta else None
            if lp is not None:
                if not mine:  # tokens held back by a parser still report their logprobs
                    mine.append(self._chunk(c.index, {}))
                mine[0]["choices"][0]["logprobs"] = lp
            if c.finished:
                self.done.add(c.index)
                reason = "tool_calls" if parser.called_tools else c.finish_reason
                mine.append(self._chunk(c.index, {}, reason))
                mine[-1]["choices"][0]["stop_reason"] = c.stop_reason
            events += mine
        if stream.finished:
            finals = list(stream.finals.values())
            if self.req.include_usage:
                events.append(
                    {**self._head("chat.completion.chunk"), "choices": [], "usage": usage(finals)}
                )
            events[-1]["timings"] = timings(finals)
        return events


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    state = request.app[STATE]
    ctx = state.ready()
    body = await read_json(request)
    # Off the event loop: rendering a long chat and tokenizing it take a while (offload.py)
    req = await asyncio.get_running_loop().run_in_executor(None, parse_request, body, ctx)
    rid = ctx.new_id("chatcmpl")
    request[ACCESS] = rid
    item = EngineRequest(rid, req.prompt_token_ids, req.params, req.prompt)
    response = _Response(req, ctx, rid)
    await check_structured(req)
    stream = request[STREAM] = await ctx.submit([item], arrival, state.config.retry_after_s)
    try:
        if not req.stream:
            body = response.body((await stream.collect())[0])
            return web.Response(body=dumps(body), content_type="application/json")
        return await stream_response(request, stream, response.first_chunks(), response.chunks)
    finally:
        stream.close()
