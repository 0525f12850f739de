"""One streamed request against an OpenAI-compatible server, timed as it arrives.

The hot path is one `perf_counter()` per network read and, per SSE event, a few byte searches
that recognize an ordinary token chunk (`plain_token_event`) or else one `json.loads`
(`read_event`, the reference); the arrival times of the events that carry new tokens are kept as
they are, and everything derived from them (TTFT, the gaps) is computed after the stream ends.
"""

from __future__ import annotations

import json
from array import array
from time import perf_counter

import aiohttp

OK = 200


class Record:
    """What one request measured; times are `perf_counter()` seconds."""

    __slots__ = (
        "index",
        "sent",
        "done",
        "times",
        "status",
        "error",
        "prompt_tokens",
        "output_tokens",
    )

    def __init__(self, index: int):
        self.index = index
        self.sent = self.done = 0.0
        self.times = array("d")  # arrival of each event that carried new tokens (8 bytes each)
        self.status = OK  # HTTP status, or 0 when no response came (connection, timeout)
        self.error: str | None = None
        self.prompt_tokens: int | None = None  # from the usage chunk, when the server sends one
        self.output_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK and self.error is None


def _carries_tokens_completion(choice: dict) -> bool:
    # A chunk with empty text still carries a token when the request has not finished (text
    # held back mid-UTF-8, a special token); a finish-only chunk with no text carries none.
    return bool(choice.get("text")) or choice.get("finish_reason") is None


def _carries_tokens_chat(choice: dict) -> bool:
    d = choice.get("delta") or {}  # the first chunk often holds only the role
    return bool(
        d.get("content") or d.get("reasoning_content") or d.get("reasoning") or d.get("tool_calls")
    )


def plain_token_event(payload: bytes, chat: bool) -> bool:
    """True when the bytes alone show an ordinary token chunk of a compact JSON encoder (kipp,
    vLLM, llama-server): one that `read_event` would count and that holds no usage and no error,
    so it needs no parse. False means "parse it". Inside a JSON string every quote is escaped, so
    text the model wrote cannot match these byte patterns."""
    if b'"finish_reason":null' not in payload or b'"usage":{' in payload or b'"error"' in payload:
        return False
    return not chat or (b'"content":"' in payload and b'"content":""' not in payload)


def read_event(ev: dict, chat: bool, rec: Record) -> bool:
    """Fill `rec` from one parsed event (usage, error); True when it carries tokens."""
    usage = ev.get("usage")
    if usage:
        rec.prompt_tokens = usage.get("prompt_tokens")
        rec.output_tokens = usage.get("completion_tokens")
    if "error" in ev:  # an error event mid-stream (the status was already 200)
        err = ev["error"]
        code = err.get("code") if isinstance(err, dict) else None
        rec.status = code if isinstance(code, int) and code >= 400 else 500
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
    choices = ev.get("choices")
    if not choices:
        return False
    return _carries_tokens_chat(choices[0]) if chat else _carries_tokens_completion(choices[0])


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        err = body.get("error", body) if isinstance(body, dict) else body
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:500]
    except ValueError:
        return raw[:500].decode("utf-8", "replace")


async def stream_request(
    session: aiohttp.ClientSession, url: str, body: bytes, chat: bool, rec: Record
) -> Record:
    """POST `body` (JSON bytes, "stream": true) to `url` and fill `rec`; never raises for a
    failed request: the status and message go into the record."""
    times = rec.times
    rec.sent = perf_counter()
    try:
        async with session.post(
            url, data=body, headers={"Content-Type": "application/json"}
        ) as resp:
            if resp.status != OK:
                rec.status, rec.error = resp.status, _error_message(await resp.read())
                return rec
            tail = b""
            async for data in resp.content.iter_any():
                t = perf_counter()
                lines = (tail + data).split(b"\n")
                tail = lines.pop()
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, "event:" lines
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    if plain_token_event(payload, chat) or read_event(
                        json.loads(payload), chat, rec
                    ):
                        times.append(t)
    except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as e:
        rec.status = rec.status if rec.status != OK else 0
        rec.error = f"{type(e).__name__}: {e}"[:500]
    finally:
        rec.done = perf_counter()
    return rec
