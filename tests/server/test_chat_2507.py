"""The 2507 checkpoints' templates through the server and the official client: Thinking-2507's
prompt opens the think block, so its output (forced here, conftest.SCRIPTS) has only `</think>`
and is split into reasoning_content and content, streamed and not, whatever enable_thinking
says; Instruct-2507 never thinks and ignores enable_thinking. Prompts are checked against the
official templates rendered by jinja2 (tests/core/chat_references.py)."""

from __future__ import annotations

import openai
import pytest

from kipp_core.tokenizer import Tokenizer
from kipp_core.vocab import chat_template
from tests.core.chat_references import jinja_render
from tests.server.conftest import start_server, with_template
from tests.server.test_chat_paths import TOOLS, both, user

OFF = {"chat_template_kwargs": {"enable_thinking": False}}


def _server(tiny_path, tmp_path_factory, name):
    path = with_template(tiny_path, tmp_path_factory.mktemp(name), chat_template(name))
    return start_server(path)


@pytest.fixture(scope="module")
def thinking(tiny_path, tmp_path_factory):
    st = _server(tiny_path, tmp_path_factory, "qwen3-thinking-2507")
    yield openai.OpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0), st
    st.stop()


@pytest.fixture(scope="module")
def instruct(tiny_path, tmp_path_factory):
    st = _server(tiny_path, tmp_path_factory, "qwen3-instruct-2507")
    yield openai.OpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0), st
    st.stop()


@pytest.fixture(scope="module")
def tok(tiny_path):
    return Tokenizer(tiny_path)


def prompt_tokens(client, messages, **kw) -> int:
    r = client.chat.completions.create(model="kipp-tiny", messages=messages, max_tokens=1, **kw)
    return r.usage.prompt_tokens


@pytest.mark.parametrize("extra", [{}, OFF])
def test_thinking_2507_splits_an_output_that_only_closes_the_block(thinking, extra):
    client, st = thinking
    assert st.server.state.ctx.chat_template.name == "qwen3-thinking-2507"
    whole, stream = both(client, messages=user("[[script:think_opened]]"), extra_body=extra)
    assert whole.message.model_extra["reasoning_content"] == "The user asks."
    assert whole.message.content == "The answer is 4."
    assert (stream["reasoning"], stream["content"]) == ("The user asks.", "The answer is 4.")


def test_thinking_2507_prompt_is_the_official_one(thinking, tok):
    client, _ = thinking
    messages = user("hello there")
    want = jinja_render(messages, None, True, True, "qwen3-thinking-2507")
    assert want.endswith("<|im_start|>assistant\n<think>\n")
    assert prompt_tokens(client, messages) == len(tok.encode(want))
    assert prompt_tokens(client, messages, extra_body=OFF) == len(tok.encode(want))
    # a forced call starts the answer: the opened block is closed empty first, as Qwen3's
    # template writes an empty one
    choice = {"type": "function", "function": {"name": "get_weather"}}
    forced = jinja_render(messages, TOOLS, True, True, "qwen3-thinking-2507")
    forced += '\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
    assert "assistant\n<think>\n\n</think>\n\n<tool_call>" in forced
    n = prompt_tokens(client, messages, tools=TOOLS, tool_choice=choice)
    assert n == len(tok.encode(forced))


def test_instruct_2507_never_thinks(instruct, tok):
    client, st = instruct
    assert st.server.state.ctx.chat_template.name == "qwen3-instruct-2507"
    for extra in ({}, OFF):
        whole, stream = both(client, messages=user("[[script:think_only]]"), extra_body=extra)
        text = "<think>\nJust thinking.\n</think>\n\nThe answer is 4."
        assert (
            whole.message.content == text and "reasoning_content" not in whole.message.model_extra
        )
        assert (stream["reasoning"], stream["content"]) == ("", text)
    messages = user("hello there")
    want = jinja_render(messages, None, True, False, "qwen3-instruct-2507")
    assert prompt_tokens(client, messages) == prompt_tokens(client, messages, extra_body=OFF)
    assert prompt_tokens(client, messages) == len(tok.encode(want))
