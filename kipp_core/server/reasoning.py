"""Split Qwen3 output into OpenAI `reasoning_content` and `content`, whole or while streaming.

Thinking mode emits `<think>\\n...reasoning...\\n</think>\\n\\ncontent`; with thinking disabled the
prompt already holds an empty think block and the output is plain content. A prompt that opened
the block itself (`opened`: Qwen3-4B-Thinking-2507's template ends with `<think>\\n`) is followed by
reasoning and `</think>` alone, as vLLM's deepseek_r1 parser, which its model card names, reads it.
Trimming follows the official chat template, which renders history with `reasoning.strip('\\n')`
and `content.lstrip('\\n')`, so parsed messages render back the way the model wrote them.

Rules (both paths):
- The think block counts only when the output, after leading whitespace, starts with `<think>`,
  or when the prompt opened it (a `<think>` the model repeats there is dropped).
- Reasoning runs to the first `</think>`, or to the end when the output was cut off (max_tokens).
- Reasoning loses its leading and trailing newlines; content loses its leading newlines.
"""

from __future__ import annotations

import enum

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def split_reasoning(
    text: str, enabled: bool = True, opened: bool = False
) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole output; reasoning is None without a think block."""
    body = text.lstrip()
    if not enabled:
        return None, text
    if body.startswith(THINK_OPEN):
        body = body[len(THINK_OPEN) :]
    elif opened:
        body = text
    else:
        return None, text
    reasoning, _, content = body.partition(THINK_CLOSE)
    return reasoning.strip("\n"), content.lstrip("\n")


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag` (a proper prefix)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _Phase(enum.Enum):
    START = enum.auto()  # only whitespace or part of "<think>" so far: undecided
    REASONING = enum.auto()
    CONTENT_HEAD = enum.auto()  # right after "</think>": leading newlines are dropped
    CONTENT = enum.auto()  # everything passes straight through


class ReasoningStream:
    """Incremental `split_reasoning`: feed deltas, get (reasoning_delta, content_delta) pairs.

    Held back, and only until the next character decides them: leading whitespace and a partial
    `<think>` at the start, and in reasoning a partial `</think>` plus the newlines before it (they
    are stripped if the block ends or the output stops there). Concatenated outputs equal
    `split_reasoning` of the whole text, with None read as "".
    """

    def __init__(self, enabled: bool = True, opened: bool = False) -> None:
        self._phase = _Phase.START if enabled else _Phase.CONTENT
        self._opened = opened  # the prompt opened the block: undecided text is reasoning
        self._pending = ""
        self._reasoning_started = False  # leading newlines are gone once reasoning text is out

    @property
    def in_reasoning(self) -> bool:
        return self._phase is _Phase.REASONING

    def feed(self, delta: str) -> tuple[str, str]:
        self._pending += delta
        reasoning, content = "", ""
        while True:
            phase = self._phase
            r, c = self._step()
            reasoning, content = reasoning + r, content + c
            if self._phase is phase:
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of the output."""
        pending, phase = self._pending, self._phase
        self._pending, self._phase = "", _Phase.CONTENT
        if phase is _Phase.START and self._opened:
            return pending.strip("\n"), ""
        if phase is _Phase.START:
            return "", pending  # no think block after all: the text is content, unchanged
        if phase is _Phase.REASONING:
            return pending.rstrip("\n"), ""  # cut off before "</think>"
        return "", ""  # CONTENT_HEAD holds only newlines; CONTENT holds nothing

    def _step(self) -> tuple[str, str]:
        """Consume what the current phase can decide; may move to the next phase."""
        if self._phase is _Phase.START:
            self._step_start()
            return "", ""
        if self._phase is _Phase.REASONING:
            return self._step_reasoning(), ""
        if self._phase is _Phase.CONTENT_HEAD:
            self._pending = self._pending.lstrip("\n")
            if self._pending:
                self._phase = _Phase.CONTENT
            return "", ""
        content, self._pending = self._pending, ""
        return "", content

    def _step_start(self) -> None:
        body = self._pending.lstrip()
        if body.startswith(THINK_OPEN):
            self._pending = body[len(THINK_OPEN) :]
            self._phase = _Phase.REASONING
        elif not THINK_OPEN.startswith(body):  # cannot become "<think>"
            self._phase = _Phase.REASONING if self._opened else _Phase.CONTENT

    def _step_reasoning(self) -> str:
        if not self._reasoning_started:
            self._pending = self._pending.lstrip("\n")
        head, close, tail = self._pending.partition(THINK_CLOSE)
        if close:
            self._pending, self._phase = tail, _Phase.CONTENT_HEAD
            return head.rstrip("\n")
        cut = len(head[: len(head) - partial_tag_len(head, THINK_CLOSE)].rstrip("\n"))
        out, self._pending = head[:cut], head[cut:]
        if out:
            self._reasoning_started = True
        return out
