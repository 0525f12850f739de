"""Structured outputs through the official `openai` client against a real APIServer, on every
backend and both scheduling modes (async scheduling is the CUDA backend's default, where the
constraints were once ignored): response_format json_object and json_schema, tool_choice
"required" and a named function; each answer is checked with the jsonschema package. The random
model is greedy and biased toward closing strings and objects, so answers end within max_tokens.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import string
import threading
import time

import jsonschema
import openai
import pytest

from kipp_core.tokenizer import Tokenizer
from tests.conformance.conftest import _available
from tests.core.test_json_constraint import gaps_follow_gbnf
from tests.server.test_chat_paths import STRICT_TOOL

SCHEMA = STRICT_TOOL["function"]["parameters"]  # every key required, an integer, an enum
TOOLS = [
    {"type": "function", "function": {"name": "book", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}},
]
CONFIGS = [(b, a) for b in ("oracle", "cuda", "mlx") for a in (True, False)]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def start(tiny_path, backend: str, async_scheduling: bool = True, max_model_len=512, **config):
    from kipp_core.llm import LLM
    from kipp_core.server.context import ServerConfig
    from kipp_core.server.server import APIServer, ServerThread

    llm = LLM(
        str(tiny_path),
        backend=backend,
        dtype="float32",
        async_scheduling=async_scheduling,
        max_model_len=max_model_len,
    )
    server = APIServer(ServerConfig(port=0, **config), llm=llm, model_name="kipp-tiny")
    return ServerThread(server).start()


@pytest.fixture(
    scope="module", params=CONFIGS, ids=[f"{b}-{'async' if a else 'sync'}" for b, a in CONFIGS]
)
def client(request, tiny_path):
    why = _available(request.param[0])
    if why:
        pytest.skip(why)
    server = start(tiny_path, *request.param)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    server.stop()


@pytest.fixture(scope="module")
def bias(tiny_path):
    tok = Tokenizer(tiny_path)
    return {str(tok.encode(s)[0]): b for s, b in (('"', 100), ("}", 60), ("]", 60), (",", 30))}


def ask(client, bias, **kw):
    kw = {"temperature": 0, "max_tokens": 80, **kw}
    return client.chat.completions.create(
        model="kipp-tiny",
        messages=[{"role": "user", "content": "Book a room."}],
        logit_bias=bias,
        extra_body=NO_THINK,
        **kw,
    ).choices[0]


def test_json_object(client, bias):
    c = ask(client, bias, response_format={"type": "json_object"})
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), {"type": "object"})
    assert gaps_follow_gbnf(c.message.content), c.message.content  # llama.cpp's whitespace


def test_json_schema(client, bias):
    fmt = {"type": "json_schema", "json_schema": {"name": "booking", "schema": SCHEMA}}
    c = ask(client, bias, response_format=fmt)
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert gaps_follow_gbnf(c.message.content), c.message.content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_forced_tool_call(client, bias, choice):
    c = ask(client, bias, tools=TOOLS, tool_choice=choice)
    [call] = c.message.tool_calls
    assert c.finish_reason == "tool_calls" and call.function.name in ("book", "ping")
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    if choice != "required":
        assert call.function.name == "book"


# -- one oracle server, for what is not about the backend ------------------------------------------


@pytest.fixture(scope="module")
def oracle_server(tiny_path):
    server = start(tiny_path, "oracle", max_model_len=None)
    yield server
    server.stop()


def _enum(n: int, length: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(length)) for _ in range(n)]
    schema = {"type": "object", "properties": {"pick": {"enum": words}}, "required": ["pick"]}
    schema["additionalProperties"] = False
    return {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}


def test_a_large_enum_leaves_a_request_beside_it_within_3x(oracle_server):
    """A 9,000-member enum (within the schema budget) is compiled off the event loop and the
    engine's thread, and its masks walk only what can still be written: a 20-token request
    beside it takes at most 3x its time alone (the oracle runs a batch of two in about twice the
    time of one, so the masks have about one step's time). Before, each of its masks checked
    every token against every member on the engine's step: 15 s instead of 0.1 s."""
    client = openai.OpenAI(base_url=oracle_server.url + "/v1", api_key="x", max_retries=0)
    fmt = _enum(9000, 9)
    ask(client, {}, response_format={"type": "json_object"}, max_tokens=2)  # the token table

    def victim() -> float:
        t0 = time.perf_counter()
        client.completions.create(
            model="kipp-tiny",
            prompt="The victim",
            max_tokens=20,
            temperature=0,
            extra_body={"ignore_eos": True},
            timeout=60,
        )
        return time.perf_counter() - t0

    def beside(seed: int) -> float:
        big = threading.Thread(
            target=ask, args=(client, {}), kwargs={"response_format": fmt, "seed": seed}
        )
        big.start()
        time.sleep(0.005)  # the enum first
        t = victim()
        big.join()
        return t

    victim()
    # alone and beside in turns, so that a shared host's load drifts over both alike
    times = [(victim(), beside(seed)) for seed in range(5)]
    alone = statistics.median(a for a, _ in times)
    assert statistics.median(b for _, b in times) <= 3 * alone, times


def test_a_schema_over_the_budget_is_a_400(oracle_server):
    """Enum members count with their length, and $refs as they expand: 9,000 members of 40
    characters, or a chain of refs that doubles 20 times, are 400s naming the field."""
    client = openai.OpenAI(base_url=oracle_server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, {}, response_format=_enum(9000, 40))
    assert e.value.body["param"] == "response_format" and "too large" in e.value.body["message"]
    defs = {f"d{i}": {"items": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2}} for i in range(20)}
    doubling = {"$defs": {**defs, "d20": {"type": "integer"}}, "$ref": "#/$defs/d0"}
    tool = {"type": "function", "function": {"name": "f", "parameters": doubling}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, {}, tools=[TOOLS[1], tool], tool_choice="required")
    err = e.value.body
    assert err["param"] == "tools" and "tools[1].function.parameters" in err["message"], err


def test_a_client_gone_while_the_token_table_is_built_cancels_nothing(tiny_path, bias):
    """The first constrained request starts the vocabulary's token table (~0.5 s); its client
    leaves after 20 ms. The table belongs to the engine, so the next constrained request still
    gets valid JSON (a shared future the first handler awaited unshielded was cancelled with it,
    and every later constrained request failed until restart)."""
    server = start(tiny_path, "oracle")  # fresh: no table yet
    try:
        body = json.dumps(
            {
                "model": "kipp-tiny",
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {"type": "json_object"},
                "max_tokens": 20,
                **NO_THINK,
            }
        ).encode()
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            time.sleep(0.02)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        c = ask(client, bias, response_format={"type": "json_object"})
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), {"type": "object"})
    finally:
        server.stop()
