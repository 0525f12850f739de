"""The two outside references the chat-template tests hold kipp_core.chat.render to:
transformers' apply_chat_template with the official Qwen3 template (through the kipp-tiny
tokenizer: the `hf_tok` fixture, tests/core/conftest.py), and the raw template rendered by
jinja2 in the environment transformers uses."""

from __future__ import annotations

import json

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kipp_core.chat import render
from kipp_core.vocab import chat_template


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # what transformers' _compile_jinja_template sets up (QWEN3.md §4)
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    return env


JINJA = _jinja_env().from_string(chat_template())


def jinja_render(messages, tools=None, add_generation_prompt=True, enable_thinking=True):
    return JINJA.render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )


def check(tok, messages, tools=None, gen=True, think=True) -> str:
    got = render(messages, tools, add_generation_prompt=gen, enable_thinking=think)
    assert got == jinja_render(messages, tools, gen, think)
    ref = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=gen, enable_thinking=think
    )
    assert got == ref
    return got
