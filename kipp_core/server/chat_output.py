"""What a chat front end makes of the model's output, whatever its API: reasoning, content and
tool calls, whole (`parse_output`) or as deltas (OutputParser), which give the same result by
construction (kipp_core/server/reasoning.py, tool_parser.py); and how many tokens the reasoning
took."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kipp_core.server.chat_spec import ChatRequest
from kipp_core.server.reasoning import ReasoningStream, split_reasoning
from kipp_core.server.tool_parser import (
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    new_call_id,
    parse_tool_calls,
)


@dataclass(frozen=True)
class TextDelta:
    text: str
    reasoning: bool = False  # thinking, not content


Delta = TextDelta | ToolCallDelta


@dataclass
class ChatOutput:
    reasoning: str | None  # None: no think block
    content: str | None  # None: only tool calls
    calls: list[ToolCall]


def parse_output(req: ChatRequest, text: str) -> ChatOutput:
    """The reasoning, content and tool calls of a whole output."""
    reasoning, content = split_reasoning(text, req.thinking, req.think_opened)
    calls = []
    if req.parse_tools:
        content, calls = parse_tool_calls(req.tool_prefix + content)
    return ChatOutput(reasoning if req.thinking else None, content, calls)


def reasoning_tokens(out: ChatOutput, token_ids: Sequence[int], close_id: int) -> int:
    """The output tokens of the thought: up to and with its `</think>` (all of them when it was
    cut off), 0 without one."""
    if out.reasoning is None:
        return 0
    ids = list(token_ids)
    return ids.index(close_id) + 1 if close_id in ids else len(ids)


class OutputParser:
    """One completion's text deltas as reasoning, content and tool-call deltas."""

    def __init__(self, req: ChatRequest, new_id: Callable[[], str] = new_call_id):
        self._reasoning = ReasoningStream(req.thinking, req.think_opened)
        self._tools = ToolCallStream(new_id) if req.parse_tools else None
        self.called_tools = False
        self._held: list[Delta] = []
        if self._tools is not None and req.tool_prefix:
            self._held = self._tool_deltas(self._tools.feed(req.tool_prefix))

    def feed(self, text: str) -> list[Delta]:
        out, self._held = self._held, []
        return out + self._split(*self._reasoning.feed(text))

    def read(self, c) -> list[Delta]:
        """The deltas of a CompletionOutput's new text (and of the end, once it finished)."""
        deltas = self.feed(c.text_delta)
        return deltas + self.finish() if c.finished else deltas

    def finish(self) -> list[Delta]:
        out, self._held = self._held, []
        out += self._split(*self._reasoning.finish())
        if self._tools is not None:
            out += self._tool_deltas(self._tools.finish())
        return out

    def _split(self, reasoning: str, content: str) -> list[Delta]:
        out: list[Delta] = [TextDelta(reasoning, True)] if reasoning else []
        if content and self._tools is not None:
            out += self._tool_deltas(self._tools.feed(content))
        elif content:
            out.append(TextDelta(content))
        return out

    def _tool_deltas(self, deltas) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            if isinstance(d, ToolCallDelta):
                self.called_tools = True
                out.append(d)
            else:
                out.append(TextDelta(d))
        return out
