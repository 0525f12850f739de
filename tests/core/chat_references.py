"""The two outside references the chat-template tests hold kipp_core.chat.render to:
transformers' apply_chat_template with an official template (through the kipp-tiny tokenizer:
the `hf_tok` fixture, or `hf_toks` with each template, tests/core/conftest.py), and the raw
template rendered by jinja2 in the environment transformers uses."""

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


TEMPLATES = ("qwen3", "qwen3-instruct-2507", "qwen3-thinking-2507")
JINJA = {name: _jinja_env().from_string(chat_template(name)) for name in TEMPLATES}


def jinja_render(
    messages, tools=None, add_generation_prompt=True, enable_thinking=True, template="qwen3"
):
    return JINJA[template].render(
        messages=messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )


def check(tok, messages, tools=None, gen=True, think=True, template="qwen3") -> str:
    got = render(
        messages, tools, add_generation_prompt=gen, enable_thinking=think, template=template
    )
    assert got == jinja_render(messages, tools, gen, think, template)
    ref = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=gen, enable_thinking=think
    )
    assert got == ref
    return got
