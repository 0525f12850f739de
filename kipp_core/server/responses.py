"""POST /v1/responses, OpenAI's Responses API over the shared chat request
(kipp_core/server/responses_request.py reads the body).

The answer's `output` items: a `reasoning` item (its text as `reasoning_text` content), a
`message` (one `output_text` part) and a `function_call` per call. An empty reasoning is left out;
an answer with neither text nor calls has an empty message. `status` is `completed`, or
`incomplete` with `incomplete_details.reason: "max_output_tokens"`; `usage` counts the reasoning's
tokens. A stream sends `response.created` and `response.in_progress`, per item
`response.output_item.added`, its deltas (`response.reasoning_text.delta`,
`response.output_text.delta` after `response.content_part.added`,
`response.function_call_arguments.delta`, whose fragments concatenate to the call's JSON) and
their `.done` events, then `response.completed` (or `response.incomplete`) with the whole
response; an engine failure is `response.failed`. Every event has its `sequence_number`.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from kipp_core.server.chat_handler import serve_chat
from kipp_core.server.chat_output import OutputParser, TextDelta, parse_output, reasoning_tokens
from kipp_core.server.chat_spec import ChatRequest
from kipp_core.server.context import ServingContext
from kipp_core.server.responses_request import parse_request
from kipp_core.server.tool_parser import new_call_id


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning(text: str, item_id: str, status: str = "completed") -> dict:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(text: str, item_id: str, status: str = "completed") -> dict:
    content = [_part(text)] if status == "completed" else []
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call(name: str, arguments: str, call_id: str, item_id: str, status="completed") -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class _Response:
    named = True

    def __init__(self, req: ChatRequest, ctx: ServingContext, request_id: str):
        self.req, self.ctx, self.id = req, ctx, request_id
        self.created = int(time.time())
        self.parser = OutputParser(req)
        self.close_id = ctx.tokenizer.token_to_id("</think>")
        self.seq = 0
        self.items: list[dict] = []  # the output items done so far
        self.open: dict | None = None  # the item being streamed
        self.text = ""  # its text (or arguments) so far
        self.token_ids: list[int] = []  # the output so far (a stream's outputs are deltas)
        self.output = ""

    def _object(self, status: str, output: list, usage=None, error=None) -> dict:
        e = self.req.echo
        fmt = (e.get("text") or {}).get("format") or {"type": "text"}
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": e.get("instructions"),
            "max_output_tokens": e.get("max_output_tokens"),
            "metadata": e.get("metadata") or {},
            "model": self.ctx.model_name,
            "output": output,
            "parallel_tool_calls": e.get("parallel_tool_calls") is not False,
            "previous_response_id": None,
            "reasoning": {"effort": (e.get("reasoning") or {}).get("effort"), "summary": None},
            "store": False,
            "temperature": e.get("temperature"),
            "text": {"format": fmt},
            "tool_choice": e.get("tool_choice") or "auto",
            "tools": e.get("tools") or [],
            "top_p": e.get("top_p"),
            "truncation": e.get("truncation") or "disabled",
            "usage": usage,
            "user": e.get("user"),
        }

    def _usage(self, final, text: str, token_ids) -> dict:
        m = final.metrics
        thought = reasoning_tokens(parse_output(self.req, text), token_ids, self.close_id)
        return {
            "input_tokens": m.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": m.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": m.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": m.num_prompt_tokens + m.num_output_tokens,
        }

    def _status(self, c, called: bool) -> str:
        return "incomplete" if c.finish_reason == "length" and not called else "completed"

    def body(self, final) -> dict:
        c = final.outputs[0]
        out = parse_output(self.req, c.text)
        items = []
        if out.reasoning:
            items.append(_reasoning(out.reasoning, _id("rs")))
        if out.content or not out.calls:
            items.append(_message(out.content or "", _id("msg")))
        for call in out.calls:
            items.append(_call(call.name, call.arguments, new_call_id(), _id("fc")))
        usage = self._usage(final, c.text, c.token_ids)
        return self._object(self._status(c, bool(out.calls)), items, usage)

    # -- streaming ------------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def first_events(self) -> list[dict]:
        return [
            self._event("response.created", response=self._object("in_progress", [])),
            self._event("response.in_progress", response=self._object("in_progress", [])),
        ]

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _open(self, item: dict) -> list[dict]:
        events = self._close()
        self.open, self.text = item, ""
        events.append(
            self._event("response.output_item.added", output_index=len(self.items), item=item)
        )
        if item["type"] == "message":
            events.append(
                self._event(
                    "response.content_part.added", **self._where(), content_index=0, part=_part("")
                )
            )
        return events

    def _close(self) -> list[dict]:
        item = self.open
        if item is None:
            return []
        where, text, kind = self._where(), self.text, item["type"]
        if kind == "reasoning":
            done = _reasoning(text, item["id"])
            events = [
                self._event("response.reasoning_text.done", **where, content_index=0, text=text)
            ]
        elif kind == "message":
            done = _message(text, item["id"])
            events = [
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self._event(
                    "response.content_part.done", **where, content_index=0, part=_part(text)
                ),
            ]
        else:
            done = _call(item["name"], text, item["call_id"], item["id"])
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    arguments=text,
                    name=item["name"],
                )
            ]
        events.append(
            self._event("response.output_item.done", output_index=len(self.items), item=done)
        )
        self.items.append(done)
        self.open = None
        return events

    def _events(self, d) -> list[dict]:
        kind = self.open["type"] if self.open is not None else None
        if isinstance(d, TextDelta) and d.reasoning:
            out = (
                [] if kind == "reasoning" else self._open(_reasoning("", _id("rs"), "in_progress"))
            )
            self.text += d.text
            return out + [
                self._event(
                    "response.reasoning_text.delta", **self._where(), content_index=0, delta=d.text
                )
            ]
        if isinstance(d, TextDelta):
            out = [] if kind == "message" else self._open(_message("", _id("msg"), "in_progress"))
            self.text += d.text
            return out + [
                self._event(
                    "response.output_text.delta",
                    **self._where(),
                    content_index=0,
                    delta=d.text,
                    logprobs=[],
                )
            ]
        if d.id is not None:
            return self._open(_call(d.name, "", d.id, _id("fc"), "in_progress"))
        self.text += d.arguments
        return [
            self._event(
                "response.function_call_arguments.delta", **self._where(), delta=d.arguments
            )
        ]

    def events(self, out, stream) -> list[dict]:
        c = out.outputs[0]
        self.token_ids += c.token_ids_delta
        self.output += c.text_delta
        events = [e for d in self.parser.read(c) for e in self._events(d)]
        if not c.finished:
            return events
        events += self._close()
        kinds = {i["type"] for i in self.items}
        if not kinds & {"message", "function_call"}:  # an empty message, as the body has
            events += self._open(_message("", _id("msg"), "in_progress")) + self._close()
        status = self._status(c, self.parser.called_tools)
        usage = self._usage(out, self.output, self.token_ids)
        final = self._object(status, self.items, usage)
        events.append(self._event(f"response.{status}", response=final))
        return events

    def failed(self, message: str) -> list[dict]:
        error = {"code": "server_error", "message": message}
        return [
            self._event("response.failed", response=self._object("failed", self.items, error=error))
        ]


async def create_response(request: web.Request) -> web.StreamResponse:
    return await serve_chat(request, parse_request, "resp_", _Response)
