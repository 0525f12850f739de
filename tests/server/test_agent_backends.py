"""Messages and Responses over the cuda backend (its torch references and async scheduling, on a
CPU here) and the mlx backend (MLX's CPU build): the in-process server answers as that backend's
offline engine does without a budget, run in two parts around the forced close (the references
of test_agent_clients.py), thought and text apart, streamed and not."""

from __future__ import annotations

import anthropic
import openai
import pytest

from kipp_core.llm import LLM
from kipp_core.server.context import ServerConfig
from kipp_core.server.server import APIServer, ServerThread
from kipp_core.vocab import chat_template
from tests.conformance.conftest import _available
from tests.server.conftest import with_template
from tests.server.test_agent_clients import GREEDY, TEMPLATE, USER, blocks, expected, items


@pytest.fixture(scope="module")
def model_dir(tiny_path, tmp_path_factory):
    return with_template(tiny_path, tmp_path_factory.mktemp("thinking"), chat_template(TEMPLATE))


@pytest.mark.parametrize("backend", ["cuda", "mlx"])
def test_messages_and_responses_on_the_backend(model_dir, backend):
    why = _available(backend)
    if why:
        pytest.skip(why)
    offline = LLM(str(model_dir), backend=backend, dtype="float32")
    llm = LLM(str(model_dir), backend=backend, dtype="float32")
    config = ServerConfig(port=0, default_thinking_budget=2)
    st = ServerThread(APIServer(config, llm=llm, model_name="kipp-tiny")).start()
    try:
        claude = anthropic.Anthropic(base_url=st.url, api_key="x", max_retries=0)
        kw = dict(model="kipp-tiny", max_tokens=7, messages=USER, extra_body=GREEDY)
        kw["thinking"] = {"type": "enabled", "budget_tokens": 3}
        think, text = expected(offline, USER, 3, 7)
        assert blocks(claude.messages.create(**kw)) == {"thinking": think, "text": text}
        with claude.messages.stream(**kw) as s:
            assert blocks(s.get_final_message()) == {"thinking": think, "text": text}
        oai = openai.OpenAI(base_url=st.url + "/v1", api_key="x", max_retries=0)
        r = oai.responses.create(
            model="kipp-tiny", input=USER[0]["content"], max_output_tokens=6, temperature=0
        )
        think, text = expected(offline, USER, 2, 6)
        assert items(r) == {"reasoning": think, "message": text}
    finally:
        st.stop()
