"""`tool_choice: "required"` or a named function: token masks that make the output one well-formed
Qwen3 tool call.

After the prompt's forced `<tool_call>\\n`, the output must read
`{"name": NAME, "arguments": ` for one of the offered names (JSON-quoted as the template writes
them), then one JSON object (the json_object masks of json_constraint.py), then `}\\n`, the
`</tool_call>` token and a stop token. For a named function the prompt forces the opening up to
`"arguments": ` too (`opened`), and the output starts at the JSON object. Fixed text is matched
token by token without spilling past its end, so each part starts at a token boundary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kipp_core.json_constraint import JsonConstraint, TokenTable

_NAME, _ARGS, _CLOSE, _END_TOKEN, _STOP = range(5)
_CLOSING = "}\n"


@dataclass
class _Stream:
    num_read: int = 0  # output tokens read so far
    phase: int = _NAME
    text: str = ""  # what the current fixed-text part has read
    args_start: int = 0  # index of the arguments' first output token
    name: int = 0  # which of the names the call took


class ToolCallConstraint:
    """One request's forced tool call, per completion stream."""

    def __init__(
        self,
        table: TokenTable,
        names: Sequence[str],
        end_token: int,
        opened: bool = False,
        schemas: Sequence | None = None,
    ):
        self.table = table
        self.opened = opened  # the prompt already holds the opening: the output starts at _ARGS
        self.openings = [  # Latin-1 views of the UTF-8 bytes, like the token texts
            ('{"name": ' + json.dumps(n, ensure_ascii=False) + ', "arguments": ')
            .encode()
            .decode("latin-1")
            for n in names
        ]
        self.end_token = end_token  # </tool_call>
        # each name's arguments: one JSON object, held to its parameters' schema if given
        self.args = [JsonConstraint(table, schema=sc) for sc in (schemas or [None] * len(names))]
        self._streams: dict[int, _Stream] = {}

    def allowed(
        self, stream: int, output_token_ids: Sequence[int], stop_token_ids: Sequence[int]
    ) -> np.ndarray:
        """The mask for the next token of `stream`: never None, the whole output is constrained."""
        st = self._streams.setdefault(stream, _Stream(phase=_ARGS if self.opened else _NAME))
        for i in range(st.num_read, len(output_token_ids)):
            self._read(st, stream, output_token_ids, i)
        st.num_read = len(output_token_ids)
        m = np.zeros(self.table.vocab_size, dtype=bool)
        if st.phase == _NAME:
            self._allow_prefixes(
                m, [o[len(st.text) :] for o in self.openings if o.startswith(st.text)]
            )
        elif st.phase == _ARGS:
            m |= self.args[st.name].allowed(stream, output_token_ids[st.args_start :], ())
        elif st.phase == _CLOSE:
            self._allow_prefixes(m, [_CLOSING[len(st.text) :]])
        elif st.phase == _END_TOKEN:
            m[self.end_token] = True
        else:
            m[[i for i in stop_token_ids if 0 <= i < m.size]] = True
        return m

    def _allow_prefixes(self, m: np.ndarray, rests: list[str]) -> None:
        # tokens whose text is a non-empty prefix of one of `rests`
        index = self.table.ids_by_text
        for rest in rests:
            for k in range(1, len(rest) + 1):
                m[index.get(rest[:k], [])] = True

    def _read(self, st: _Stream, stream: int, out: Sequence[int], i: int) -> None:
        text = self.table.texts[out[i]]
        if st.phase == _NAME:
            st.text += text
            if st.text in self.openings:
                st.name = self.openings.index(st.text)
                st.phase, st.text, st.args_start = _ARGS, "", i + 1
        elif st.phase == _ARGS:
            if self.args[st.name].read(stream, out[st.args_start : i + 1]):
                st.phase = _CLOSE
        elif st.phase == _CLOSE:
            st.text += text
            if st.text == _CLOSING:
                st.phase = _END_TOKEN
        elif st.phase == _END_TOKEN:
            st.phase = _STOP
