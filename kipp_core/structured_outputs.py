"""Structured outputs (vLLM's name): what a request's output is held to, as plain data on
SamplingParams. The engine compiles it (kipp_core/structured_output_manager.py) and masks each
step's logits with what it allows.

One of: `json_object` (one JSON object), `json_schema` (a value valid for a JSON schema, the subset
kipp_core/json_schema.py compiles), or `tools` (one Qwen3 tool call, `{"name": NAME, "arguments":
ARGS}\\n</tool_call>`, of one of the named tools, ARGS valid for its parameters schema). With
`tool_call_opened` (one tool) the prompt already holds the call's opening up to its arguments, so
the output starts at them. With `start_after` the output is free up to and including that token
(`</think>` when the model thinks first).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

from kipp_core.json_schema import ANY_OBJ, Obj, compile_schema

_COMPILED: dict[str, tuple] = {}  # canonical schemas' JSON -> (compiled,), oldest first
_MAX_COMPILED = 64
_LOCK = threading.Lock()


class StructuredOutputsError(ValueError):
    """A schema that does not compile: `tool` is its index in `tools`, or None (json_schema)."""

    def __init__(self, reason: str, tool: int | None = None):
        where = "json_schema" if tool is None else f"tools[{tool}] parameters"
        super().__init__(f"structured_outputs {where}: {reason}")
        self.reason, self.tool = reason, tool


def _bad(rule: str, value) -> ValueError:
    return ValueError(f"structured_outputs {rule}, got {value!r:.80}")


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output is held to; validated on construction (a ValueError names the field).
    `compiled()` checks the schemas (bounded: json_schema.MAX_SCHEMA_SIZE) and keeps the result."""

    json_object: bool = False
    json_schema: dict | bool | None = None
    tools: tuple[tuple[str, dict | None], ...] | None = None  # (name, parameters schema)
    tool_call_opened: bool = False
    start_after: int | None = None
    _nodes: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.json_object, bool):
            raise _bad("json_object must be a bool", self.json_object)
        kinds = [self.json_object, self.json_schema is not None, self.tools is not None]
        if sum(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json_object, json_schema and tools"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise _bad("json_schema must be an object or a boolean", self.json_schema)
        if self.tools is not None:
            tools = tuple(self.tools) if isinstance(self.tools, (list, tuple)) else None
            if not tools or not all(_is_tool(t) for t in tools):
                raise _bad("tools must be (name, parameters object or None) pairs", self.tools)
            object.__setattr__(self, "tools", tuple((n, p) for n, p in tools))
        if not isinstance(self.tool_call_opened, bool):
            raise _bad("tool_call_opened must be a bool", self.tool_call_opened)
        if self.tool_call_opened and (self.tools is None or len(self.tools) != 1):
            raise ValueError("structured_outputs tool_call_opened needs exactly one tool")
        s = self.start_after
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
            raise _bad("start_after must be a token id", s)

    def __getstate__(self):  # the compiled schemas stay behind (made again where needed)
        return {k: v for k, v in self.__dict__.items() if k != "_nodes"}

    def compiled(self):
        """The compiled schema (json_schema), each tool's compiled parameters (tools: an object
        node each; a schema that is not an object allows any object), or None (json_object).
        StructuredOutputsError says which schema fails and why. Requests with the same schemas
        share one compiled result (and so the masks cached for it)."""
        if self._nodes is None:
            try:
                key = json.dumps([self.json_schema, self.tools], sort_keys=True)
            except (TypeError, ValueError):  # not JSON (keys of mixed types): not shared
                key = None
            with _LOCK:
                nodes = _COMPILED.get(key) if key is not None else None
            if nodes is None:
                nodes = (self._compile(),)
                with _LOCK:
                    if key is not None:
                        _COMPILED[key] = nodes
                    while len(_COMPILED) > _MAX_COMPILED:
                        _COMPILED.pop(next(iter(_COMPILED)))
            object.__setattr__(self, "_nodes", nodes)
        return self._nodes[0]

    def _compile(self):
        if self.json_schema is not None:
            try:
                return compile_schema(self.json_schema)
            except ValueError as e:
                raise StructuredOutputsError(str(e)) from None
        if self.tools is None:
            return None
        out = []
        for i, (_, params) in enumerate(self.tools):
            try:
                node = compile_schema(params or {})
            except ValueError as e:
                raise StructuredOutputsError(str(e), i) from None
            out.append(node if isinstance(node, Obj) else ANY_OBJ)
        return tuple(out)


def _is_tool(t) -> bool:
    return (
        isinstance(t, (list, tuple))
        and len(t) == 2
        and isinstance(t[0], str)
        and bool(t[0])
        and (t[1] is None or isinstance(t[1], dict))
    )
