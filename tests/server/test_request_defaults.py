"""What a chat request may leave out: an assistant message that calls tools has no content (as
OpenAI allows); max_tokens, whose absence means the rest of the context (vLLM's), or at most
`--default-max-tokens` (ServerConfig.default_max_tokens) when the server sets one."""

from __future__ import annotations

import openai
import pytest

from kipp_core.server.context import ServerConfig
from tests.server.conftest import start_server

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def capped(tiny_path):
    server = start_server(tiny_path, ServerConfig(port=0, default_max_tokens=3))
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    server.stop()


def test_default_max_tokens_caps_requests_without_one(capped):
    r = capped.chat.completions.create(
        model="kipp-tiny",
        messages=[{"role": "user", "content": "Hi"}],
        temperature=0,
        logit_bias={"151645": -100, "151643": -100},  # never ends by itself
        extra_body=NO_THINK,
    )
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = capped.chat.completions.create(
        model="kipp-tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        logit_bias={"151645": -100, "151643": -100},
        extra_body=NO_THINK,
    )
    assert r.usage.completion_tokens == 5  # a request's own max_tokens wins


def test_an_assistant_message_with_tool_calls_needs_no_content(capped):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = capped.chat.completions.create(
        model="kipp-tiny",
        messages=[
            {"role": "user", "content": "call f"},
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ],
        max_tokens=1,
    )
    assert r.choices[0].message.role == "assistant"
