"""POST /v1/messages and /v1/messages/count_tokens, Anthropic's Messages API over the shared chat
request (kipp_core/server/messages_request.py reads the body).

The answer's content blocks: a `thinking` block (the reasoning; its `signature` is empty, since
nothing is signed here), `text`, and a `tool_use` block per call (`toolu_` ids, `input` the
arguments). Blocks with nothing in them are left out, but an answer never has no block at all (an
empty text block then). `stop_reason` is `tool_use`, `stop_sequence` (with `stop_sequence` the
string), `max_tokens` or `end_turn`. A stream sends Anthropic's events: `message_start`, a `ping`,
then per block `content_block_start`, its deltas (`thinking_delta`, `text_delta`,
`input_json_delta` fragments that concatenate to the call's JSON) and `content_block_stop`, then
`message_delta` (the stop reason, the usage) and `message_stop`; an engine failure is an `error`
event.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import string

from aiohttp import web

from kipp_core.server.access_log import ACCESS
from kipp_core.server.body import read_json
from kipp_core.server.chat_handler import json_response, serve_chat
from kipp_core.server.chat_output import OutputParser, TextDelta, parse_output
from kipp_core.server.chat_spec import ChatRequest
from kipp_core.server.context import STATE, ServingContext
from kipp_core.server.errors import APIError
from kipp_core.server.messages_request import count_request, parse_request

_ID_CHARS = string.ascii_letters + string.digits


def new_tool_use_id() -> str:
    return "toolu_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _stop(c, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if called:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _usage(final) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens the prefix cache did not hold."""
    m = final.metrics
    return {
        "input_tokens": m.num_prompt_tokens - m.num_cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": m.num_cached_tokens,
        "output_tokens": m.num_output_tokens,
    }


class _Message:
    named = True

    def __init__(self, req: ChatRequest, ctx: ServingContext, request_id: str):
        self.req, self.ctx, self.id = req, ctx, request_id
        self.parser = OutputParser(req, new_tool_use_id)
        self.block: str | None = None  # the type of the open block
        self.index = -1  # its index

    def _message(self, content: list, stop=(None, None), usage=None) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.model_name,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    def body(self, final) -> dict:
        c = final.outputs[0]
        out = parse_output(self.req, c.text)
        content = []
        if out.reasoning:
            thinking = out.reasoning if self.req.include_reasoning else ""
            content.append({"type": "thinking", "thinking": thinking, "signature": ""})
        if out.content:
            content.append({"type": "text", "text": out.content})
        for call in out.calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": new_tool_use_id(),
                    "name": call.name,
                    "input": json.loads(call.arguments),
                }
            )
        if not content:
            content.append({"type": "text", "text": ""})
        return self._message(content, _stop(c, bool(out.calls)), _usage(final))

    def first_events(self) -> list[dict]:
        usage = {
            "input_tokens": len(self.req.prompt_token_ids),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 0,
        }
        return [
            {"type": "message_start", "message": self._message([], usage=usage)},
            {"type": "ping"},
        ]

    def _open(self, block: dict) -> list[dict]:
        events = self._close()
        self.index += 1
        self.block = block["type"]
        events.append({"type": "content_block_start", "index": self.index, "content_block": block})
        return events

    def _close(self) -> list[dict]:
        if self.block is None:
            return []
        self.block = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _events(self, d) -> list[dict]:
        if isinstance(d, TextDelta) and d.reasoning:
            out = [] if self.block == "thinking" else self._open(_THINKING)
            if self.req.include_reasoning:
                out.append(self._delta({"type": "thinking_delta", "thinking": d.text}))
            return out
        if isinstance(d, TextDelta):
            out = [] if self.block == "text" else self._open({"type": "text", "text": ""})
            return out + [self._delta({"type": "text_delta", "text": d.text})]
        if d.id is not None:
            block = {"type": "tool_use", "id": d.id, "name": d.name, "input": {}}
            return self._open(block)
        return [self._delta({"type": "input_json_delta", "partial_json": d.arguments})]

    def events(self, out, stream) -> list[dict]:
        c = out.outputs[0]
        events = [e for d in self.parser.read(c) for e in self._events(d)]
        if not c.finished:
            return events
        if self.index < 0:  # nothing came: one empty text block, as the body has
            events += self._open({"type": "text", "text": ""})
        events += self._close()
        reason, sequence = _stop(c, self.parser.called_tools)
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": _usage(out),
            }
        )
        events.append({"type": "message_stop"})
        return events

    def failed(self, message: str) -> list[dict]:
        return [APIError(500, message).anthropic_body()]


_THINKING = {"type": "thinking", "thinking": "", "signature": ""}


async def create_message(request: web.Request) -> web.StreamResponse:
    return await serve_chat(request, parse_request, "msg_", _Message)


async def count_tokens(request: web.Request) -> web.Response:
    ctx = request.app[STATE].ready()
    body = await read_json(request)
    req = await asyncio.get_running_loop().run_in_executor(None, count_request, body, ctx)
    request[ACCESS] = "count_tokens"
    return json_response({"input_tokens": len(req.prompt_token_ids)})
