"""POST /v1/chat/completions: reasoning as `reasoning_content`, tool calls as `tool_calls`, whole
or as chunks of deltas (kipp_core/server/chat_output.py parses both the same way)."""

from __future__ import annotations

import time

from aiohttp import web

from kipp_core.server.async_engine import RequestStream
from kipp_core.server.chat_handler import serve_chat
from kipp_core.server.chat_output import OutputParser, TextDelta, parse_output
from kipp_core.server.chat_request import parse_request
from kipp_core.server.chat_spec import ChatRequest
from kipp_core.server.context import ServingContext
from kipp_core.server.logprobs import chat_logprobs
from kipp_core.server.streaming import ChunkFrame, openai_error
from kipp_core.server.tool_parser import new_call_id
from kipp_core.server.usage import timings, usage


def message(req: ChatRequest, text: str) -> tuple[dict, bool]:
    """The assistant message of a whole output, and whether it called tools."""
    out = parse_output(req, text)
    msg = {"role": "assistant", "content": out.content}
    if req.thinking:
        msg["reasoning_content"] = out.reasoning
    if out.calls:
        msg["tool_calls"] = [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in out.calls
        ]
    return msg, bool(out.calls)


def _chat_delta(d) -> dict:
    """An OutputParser delta as a chat chunk's delta."""
    if isinstance(d, TextDelta):
        return {"reasoning_content" if d.reasoning else "content": d.text}
    call = {"index": d.index, "function": {"arguments": d.arguments}}
    if d.id is not None:
        call = {
            "index": d.index,
            "id": d.id,
            "type": "function",
            "function": {"name": d.name, "arguments": d.arguments},
        }
    return {"tool_calls": [call]}


class _Response:
    named = False

    def __init__(self, req: ChatRequest, ctx: ServingContext, request_id: str):
        self.req, self.ctx = req, ctx
        self.id = request_id
        self.created = int(time.time())
        self.parsers = [OutputParser(req) for _ in range(req.params.n)]
        self.done: set[int] = set()
        self.plain = ChunkFrame(self._head("chat.completion.chunk"), "delta", req.include_usage)

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

    def first_events(self) -> list[dict]:
        return [
            self._chunk(i, {"role": "assistant", "content": ""}) for i in range(len(self.parsers))
        ]

    def events(self, out, stream: RequestStream) -> list:
        events = []
        for c in out.outputs:
            if c.index in self.done:
                continue
            parser = self.parsers[c.index]
            deltas = [_chat_delta(d) for d in parser.read(c)]
            lp = self._logprobs(c.token_ids_delta, c.logprobs_delta) if c.token_ids_delta else None
            if lp is None and not c.finished and not stream.finished:  # most of a stream's
                events += [self.plain.frame(c.index, d) for d in deltas]
                continue
            mine = [self._chunk(c.index, d) for d in deltas]
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

    def failed(self, message: str) -> list[dict]:
        return openai_error(message)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    return await serve_chat(request, parse_request, "chatcmpl", _Response)
