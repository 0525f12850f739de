"""ChunkFrame's bytes against the json module's serialization of the event dict it stands for."""

from __future__ import annotations

import json

import pytest

from kipp_core.server.streaming import ChunkFrame

TEXTS = ["", " hello", 'a "quote" and \\ back', "line\nbreak\ttab\r", "\u2028\u2029", "\x00\x1f",
         "naïve café 中文", "🦜 \U0001f600", "</script>"]  # fmt: skip


def _expected(head: dict, key: str, index: int, value, usage: bool) -> bytes:
    choice = {"index": index, key: value, "logprobs": None, "finish_reason": None}
    event = {**head, "choices": [choice]}
    if usage:
        event["usage"] = None
    body = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + body.encode("utf-8") + b"\n\n"


@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_completion_chunk_bytes(text, usage):
    head = {"id": "cmpl-1a2b", "object": "text_completion", "created": 1764660000, "model": "m"}
    frame = ChunkFrame(head, "text", usage)
    for index in (0, 7, 123):
        assert frame.frame(index, text) == _expected(head, "text", index, text, usage)


@pytest.mark.parametrize("usage", [False, True])
def test_chat_chunk_bytes(usage):
    head = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "Ω/é"}
    frame = ChunkFrame(head, "delta", usage)
    deltas = [{"content": t} for t in TEXTS] + [
        {"reasoning_content": 'think "x"'},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]},
        {},
    ]
    for d in deltas:
        assert frame.frame(2, d) == _expected(head, "delta", 2, d, usage)
        json.loads(frame.frame(2, d)[len(b"data: ") :])  # and it parses
