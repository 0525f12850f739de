"""The official `openai` client, sync and async, streaming and not, against `kipp serve` started as
a real process on 127.0.0.1. References: the tokenizer (token counts), the numpy oracle (greedy
tokens and prompt logprobs), hand-derived expectations (stop strings, finish reasons)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kipp_core.checkpoint import Checkpoint
from kipp_core.tokenizer import Tokenizer
from oracle.qwen3 import KVCache, forward, load_weights

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def cli_url():
    cmd = [
        sys.executable,
        "-m",
        "kipp_core.cli.main",
        "serve",
        "--model",
        "kipp-tiny",
        "--backend",
        "oracle",
        "--port",
        "0",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    lines: list[str] = []
    found = threading.Event()

    def drain():  # keep reading so the pipe never fills
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line:
                found.set()

    threading.Thread(target=drain, daemon=True).start()
    assert found.wait(60), "".join(lines)
    url = re.search(r"http://127\.0\.0\.1:\d+", "".join(lines)).group(0)
    deadline = time.monotonic() + 60
    while True:
        try:
            if urllib.request.urlopen(url + "/health").status == 200:
                break
        except Exception:  # 503 while loading, refused before binding
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)
    yield url
    proc.send_signal(2)  # SIGINT: a clean shutdown exits 0
    assert proc.wait(30) == 0, "".join(lines)


@pytest.fixture(scope="module")
def client(cli_url):
    return openai.OpenAI(base_url=cli_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(tiny_path):
    return Tokenizer(tiny_path)


@pytest.fixture(scope="module")
def weights(tiny_path):
    return load_weights(Checkpoint(tiny_path), np.float32)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_models_and_health(client, cli_url):
    models = client.models.list().data
    assert [m.id for m in models] == ["kipp-tiny"]
    assert models[0].model_extra["max_model_len"] == 4096
    assert urllib.request.urlopen(cli_url + "/health").status == 200


def test_completion_usage_and_timings(client, tok):
    r = client.completions.create(
        model="kipp-tiny", prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
    )
    n_prompt = len(tok.encode(PROMPT))
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 5)
    assert r.usage.total_tokens == n_prompt + 5
    t = r.model_extra["timings"]
    assert (t["prompt_n"] + t["cache_n"], t["predicted_n"]) == (n_prompt, 5)
    assert t["prompt_ms"] >= 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert 0 < t["ttft_ms"] < 60_000


def test_completion_batch_of_token_prompts_with_n(client):
    r = client.completions.create(
        model="kipp-tiny",
        prompt=[[1, 2, 3], [4, 5]],
        n=2,
        max_tokens=3,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12


def test_greedy_completion_matches_oracle(client, tok, weights):
    ids = tok.encode(PROMPT)
    r = client.completions.create(
        model="kipp-tiny",
        prompt=ids,
        max_tokens=6,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    cache = KVCache(weights.config.num_hidden_layers)
    logits = forward(weights, ids, 0, cache)
    want = []
    for _ in range(6):
        want.append(int(np.argmax(logits[-1])))
        logits = forward(weights, [want[-1]], cache.length, cache)
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert r.choices[0].logprobs.tokens == [tok.id_to_piece(t) for t in want]


def test_echo_scoring_matches_oracle(client, tok, weights):
    """echo + logprobs + max_tokens 0: what lm-eval's loglikelihood requests send."""
    ids = tok.encode(PROMPT + " jumps over the lazy dog")
    r = client.completions.create(
        model="kipp-tiny", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    c = r.choices[0]
    assert c.text == tok.decode(ids) and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.tokens == [tok.id_to_piece(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = log_softmax(forward(weights, ids))
    expected = [want[i, ids[i + 1]] for i in range(len(ids) - 1)]
    np.testing.assert_allclose(lp.token_logprobs[1:], expected, atol=1e-4)
    for i, top in enumerate(lp.top_logprobs[1:]):  # top-1 and the prompt token itself
        best = int(np.argmax(want[i]))
        assert top[tok.id_to_piece(best)] == pytest.approx(want[i, best], abs=1e-4)
        assert len(top) <= 2


def test_completion_stream_equals_non_stream(client):
    kw = dict(
        model="kipp-tiny",
        prompt=PROMPT,
        max_tokens=8,
        n=2,
        seed=11,
        temperature=0.9,
        logprobs=2,
        extra_body={"ignore_eos": True, "top_k": 50},
    )
    whole = client.completions.create(**kw)
    text = {c.index: "" for c in whole.choices}
    tokens = {c.index: [] for c in whole.choices}
    finish = {}
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    for ch in chunks[:-1]:
        for c in ch.choices:
            text[c.index] += c.text
            tokens[c.index] += c.logprobs.tokens
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in whole.choices:
        assert text[c.index] == c.text and tokens[c.index] == c.logprobs.tokens
        assert finish[c.index] == c.finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].model_extra["timings"]["predicted_n"] == 16


def test_stop_string_cuts_at_its_first_occurrence(client):
    kw = dict(model="kipp-tiny", prompt=PROMPT, max_tokens=10, seed=5, temperature=1.0)
    full = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    for stream in (False, True):
        r = client.completions.create(
            stop=[stop], stream=stream, **kw, extra_body={"ignore_eos": True}
        )
        choices = [c for ch in r for c in ch.choices] if stream else r.choices
        assert "".join(c.text for c in choices) == full[: full.index(stop)]
        assert choices[-1].finish_reason == "stop"


def test_chat_async_stream_equals_non_stream(cli_url):
    async def run():
        client = openai.AsyncOpenAI(base_url=cli_url + "/v1", api_key="x", max_retries=0)
        kw = dict(
            model="kipp-tiny",
            messages=[{"role": "user", "content": "Hi there"}],
            max_completion_tokens=8,
            seed=2,
            temperature=0.8,
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True},
        )
        whole = await client.chat.completions.create(**kw)
        stream = await client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kw
        )
        chunks = [ch async for ch in stream]
        await client.close()
        return whole, chunks

    whole, chunks = asyncio.run(run())
    msg = whole.choices[0].message
    assert msg.role == "assistant" and whole.usage.completion_tokens == 8
    assert "reasoning_content" in msg.model_extra  # thinking is on by default
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in chunks
        if c.choices
    )
    assert content == (msg.content or "") and reasoning == (
        msg.model_extra["reasoning_content"] or ""
    )
    lps = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in lps] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert "timings" in chunks[-1].model_extra


def test_chat_logprobs_shape(client):
    r = client.chat.completions.create(
        model="kipp-tiny",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=4,
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert "reasoning_content" not in r.choices[0].message.model_extra
    entries = r.choices[0].logprobs.content
    assert len(entries) == 3
    for e in entries:
        assert bytes(e.bytes).decode("utf-8", "backslashreplace") == e.token
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True) and e.logprob <= tops[0]


def test_errors_reach_the_client_as_openai_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="kipp-tiny", prompt=PROMPT, max_tokens=5000)
    assert e.value.body["param"] == "max_tokens"
    assert "4096" in e.value.message and "5000" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="kipp-tiny", messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="kipp-tiny", prompt="x", extra_body={"frobnicate": 1})
    assert e.value.body["param"] == "frobnicate"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x")
    assert e.value.body["code"] == "model_not_found"


def test_metrics_parse_as_prometheus(client, cli_url):
    for _ in range(2):
        client.completions.create(model="kipp-tiny", prompt="x", max_tokens=1)
    text = urllib.request.urlopen(cli_url + "/metrics").read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "kipp_requests",
        "kipp_time_to_first_token_seconds",
        "kipp_queue_wait_seconds",
        "kipp_prompt_tokens",
        "kipp_generation_tokens",
        "kipp_num_requests_running",
        "kipp_num_requests_waiting",
        "kipp_kv_blocks_used",
        "kipp_prefix_cache_hit_rate",
    ):
        assert name in families, name
    ok = [
        s
        for s in families["kipp_requests"].samples
        if s.labels.get("status") == "200" and s.name.endswith("_total")
    ]
    assert sum(s.value for s in ok) >= 2
    ttft = [
        s for s in families["kipp_time_to_first_token_seconds"].samples if s.name.endswith("_count")
    ]
    assert ttft[0].value >= 2
