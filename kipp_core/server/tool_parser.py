"""Qwen3 (Hermes-style) tool calls in content, parsed whole or while streaming.

The model writes `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, possibly several
times and possibly after some text. Rules shared by `parse_tool_calls` and `ToolCallStream`:

- A block runs from `<tool_call>` to the first `</tool_call>` after it. It is a call when its inner
  text is a JSON object with a non-empty string "name" and an "arguments" (else "parameters") field
  that is an object or a string holding a JSON object. Any other block, and a block never closed,
  stays in the content as plain text.
- `arguments` is `json.dumps(obj, ensure_ascii=False)`, or the model's own string when it already
  was a JSON-object string.
- Whitespace: with no calls the content is returned unchanged. With calls, the content is the text
  outside them with trailing whitespace removed, and leading whitespace removed only when no visible
  text precedes the first call (text before a call is already streamed when the call shows up, so
  its leading whitespace cannot be taken back). Content left empty becomes None.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass

from kipp_core.json_prefix import JsonPrefix
from kipp_core.server.reasoning import partial_tag_len

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI streaming `tool_calls` entry: the first per call carries id and name."""

    index: int
    id: str | None
    name: str | None
    arguments: str


Delta = str | ToolCallDelta  # str: a content delta


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # json.loads would accept NaN and Infinity


def _loads(text: str) -> object:
    """json.loads held to strict JSON; None for anything that fails to parse."""
    try:
        return json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        return None


def _utf8_ok(text: str) -> bool:
    """False for text holding a lone surrogate (from a "\\ud800" escape): it cannot be sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _arguments_text(args: object) -> str | None:
    if isinstance(args, str):
        parsed = _loads(args)
        if not isinstance(parsed, dict):
            return None
        if _utf8_ok(args):
            return args
        args = parsed  # re-encoded below, with the surrogate escaped
    if not isinstance(args, dict):
        return None
    try:  # allow_nan: a number like 1e999 parses to inf, which has no JSON spelling
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    return text if _utf8_ok(text) else json.dumps(args)


def parse_call(inner: str) -> ToolCall | None:
    """The call written between the tags, or None if the block is not a valid call."""
    obj = _loads(inner)
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or not _utf8_ok(name):
        return None
    arguments = _arguments_text(obj["arguments"] if "arguments" in obj else obj.get("parameters"))
    return None if arguments is None else ToolCall(name, arguments)


def parse_tool_calls(content: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; see the module docstring for the rules."""
    calls: list[ToolCall] = []
    outside: list[str] = []
    visible_before_call = False
    pos = 0
    while (start := content.find(OPEN, pos)) >= 0:
        end = content.find(CLOSE, start + len(OPEN))
        if end < 0:
            break  # never closed: the rest is text
        call = parse_call(content[start + len(OPEN) : end])
        end += len(CLOSE)
        if call is None:
            outside.append(content[pos:end])
        else:
            outside.append(content[pos:start])
            if not calls:
                visible_before_call = bool("".join(outside).strip())
            calls.append(call)
        pos = end
    if not calls:
        return content, []
    text = ("".join(outside) + content[pos:]).rstrip()
    if not visible_before_call:
        text = text.lstrip()
    return text or None, calls


def _split_arguments(arguments: str) -> list[str]:
    """Two fragments, so clients that only handle a single one are caught early."""
    half = len(arguments) // 2
    return [part for part in (arguments[:half], arguments[half:]) if part]


class ToolCallStream:
    """Incremental `parse_tool_calls`: feed content deltas, get content and tool-call deltas.

    Content streams live except: a partial `<tool_call>` at the end (could be a tag), trailing
    whitespace (dropped at the end if any call was found), and leading whitespace (dropped if a call
    comes first). A block is buffered until `</tool_call>` and emitted only if valid, so argument
    fragments always add up to the non-streaming `arguments`. A block is released as text as soon as
    its inner text can no longer be a JSON object (checked with `JsonPrefix`), or can no longer be a
    valid call (its object is complete but has no name, say), or at `finish()` if never closed.
    """

    def __init__(self, id_factory: Callable[[], str] = new_call_id) -> None:
        self._new_id = id_factory
        self._buf = ""  # unread text; in a block, the inner text read so far
        self._in_block = False
        self._bad_block = False  # the open block is known invalid: text until its "</tool_call>"
        self._json = JsonPrefix()  # the open block's inner text, as far as known to be inner
        self._json_len = 0
        self._calls = 0
        self._held_ws = ""  # trailing content whitespace not yet sent
        self._visible = False  # some non-whitespace content has been sent
        self._out: list[Delta] = []

    def feed(self, delta: str) -> list[Delta]:
        self._buf += delta
        while self._step():
            pass
        return self._drain()

    def finish(self) -> list[Delta]:
        """Flush the end of the output: an unclosed block is text; trailing whitespace resolves."""
        if self._in_block and not self._bad_block:
            self._buf = OPEN + self._buf
        self._content(self._buf)
        self._buf, self._in_block, self._bad_block = "", False, False
        if not self._calls:
            self._out.append(self._held_ws)  # no calls: content is returned unchanged
        self._held_ws = ""
        return self._drain()

    def _step(self) -> bool:
        """Read what can be decided now; True when a tag was crossed and reading should go on."""
        if not self._in_block:
            return self._step_text()
        if self._bad_block:
            return self._step_bad_block()
        return self._step_block()

    def _step_text(self) -> bool:
        start = self._buf.find(OPEN)
        if start < 0:
            keep = partial_tag_len(self._buf, OPEN)
            self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._content(self._buf[:start])
        self._buf = self._buf[start + len(OPEN) :]
        self._in_block, self._json, self._json_len = True, JsonPrefix(), 0
        return True

    def _step_block(self) -> bool:
        end = self._buf.find(CLOSE, self._json_len)  # no close tag starts before _json_len
        if end >= 0:
            inner, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
            self._in_block = False
            call = parse_call(inner)
            if call is None:
                self._content(OPEN + inner + CLOSE)
            else:
                self._emit_call(call)
            return True
        if self._still_plausible():
            return False
        self._content(OPEN)  # released early: the block's text now streams as content
        self._bad_block = True
        return True

    def _still_plausible(self) -> bool:
        """Whether the block read so far could still turn out a valid call."""
        known = len(self._buf) - partial_tag_len(self._buf, CLOSE)  # surely before the close tag
        was_complete = self._json.is_complete
        if not self._json.feed(self._buf[self._json_len : known]):
            return False
        self._json_len = max(self._json_len, known)
        if self._json.is_complete and not was_complete:  # only whitespace may follow now
            return parse_call(self._buf[: self._json_len]) is not None
        return True

    def _step_bad_block(self) -> bool:
        end = self._buf.find(CLOSE)
        if end < 0:
            keep = partial_tag_len(self._buf, CLOSE)
            self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        end += len(CLOSE)
        self._content(self._buf[:end])
        self._buf = self._buf[end:]
        self._in_block = self._bad_block = False
        return True

    def _emit_call(self, call: ToolCall) -> None:
        index = self._calls
        self._calls += 1
        self._out.append(ToolCallDelta(index, self._new_id(), call.name, ""))
        for part in _split_arguments(call.arguments):
            self._out.append(ToolCallDelta(index, None, None, part))

    def _content(self, text: str) -> None:
        """Send content, holding back trailing whitespace and trimming leading whitespace."""
        text = self._held_ws + text
        body = text.rstrip()
        self._held_ws = text[len(body) :]
        if not body:
            return
        if not self._visible and self._calls:
            body = body.lstrip()
        self._visible = True
        self._out.append(body)

    def _drain(self) -> list[Delta]:
        """The deltas produced since the last call, adjacent content merged, empty text dropped."""
        out: list[Delta] = []
        for item in self._out:
            if not isinstance(item, str):
                out.append(item)
            elif out and isinstance(out[-1], str):
                out[-1] += item
            elif item:
                out.append(item)
        self._out = []
        return out
