"""`kipp bench serve`'s load generator against a fake server whose timings are known
(tests/tools/fake_openai.py): the measured TTFT, inter-token gaps, TPOT and throughput equal the
values derived from its schedule; failed requests are counted and leave the others intact;
Poisson arrivals have the right mean; the workload is the offline benchmark's.

Bounds. The fake server writes token k at arrival + FIRST + k GAP. A request's TTFT is therefore
at least FIRST (the client stamps the send before the server can see it) and exceeds it by the
request's transit plus the write's delivery delay d: loopback and asyncio wake-ups take well under
a millisecond on an idle machine, and SLACK leaves room for a CI machine whose two cores other
jobs share. A request's mean gap is GAP + (d_last - d_first) / (M - 1), within SLACK / (M - 1).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kipp_core.cli.main import main
from kipp_core.loadgen import LoadSpec, run_load, summarize
from kipp_core.workload import (
    poisson_arrivals,
    random_workload,
    workload_digest,
)
from tests.tools.fake_openai import FIRST_S, GAP_S, MODES, FakeServer

SLACK = 0.05
M = 11  # tokens a request
R = FIRST_S + (M - 1) * GAP_S  # a request's shortest possible end-to-end time


@pytest.fixture(scope="module")
def fake():
    server = FakeServer().start()
    yield server
    server.stop()


def _run(fake, prompts, **kw):
    spec = LoadSpec(url=fake.url, model="fake-model", progress=False, **kw)
    result = run_load(spec, prompts, [M] * len(prompts))
    return result, summarize(result, [len(p) for p in prompts], [M] * len(prompts))


def _gaps(result, index: int) -> np.ndarray:
    r = result.records
    return r["itl"][r["itl_owner"] == index]


def test_timings_and_throughput_match_the_schedule(fake):
    n, waves = 6, 3  # two workers, back to back
    result, s = _run(fake, [[1, 2, 3, 4]] * n, concurrency=2)
    r = result.records
    assert s["completed"] == n and s["errors"] == 0 and s["tokens_from"] == "usage"
    assert list(r["output_tokens"]) == [M] * n and s["length_mismatches"] == 0
    assert list(r["chunks"]) == [M] * n  # the finish-only chunk carries no token
    assert np.all((FIRST_S <= r["ttft"]) & (r["ttft"] <= FIRST_S + SLACK)), r["ttft"]
    for i in range(n):
        g = _gaps(result, i)
        assert len(g) == M - 1 and abs(g.mean() - GAP_S) <= SLACK / (M - 1), g
    assert FIRST_S * 1e3 <= s["mean_ttft_ms"] <= (FIRST_S + SLACK) * 1e3
    assert abs(s["median_tpot_ms"] - GAP_S * 1e3) <= SLACK / (M - 1) * 1e3
    assert abs(s["mean_itl_ms"] - GAP_S * 1e3) <= SLACK / (M - 1) * 1e3  # the requests' means
    assert R * 1e3 <= s["median_e2el_ms"] <= (R + SLACK) * 1e3
    # duration: `waves` requests back to back per worker, each R plus at most SLACK
    assert waves * R <= result.duration <= waves * (R + SLACK)
    assert n * M / (waves * (R + SLACK)) <= s["output_throughput"] <= n * M / (waves * R)
    assert s["total_token_throughput"] == pytest.approx(n * (4 + M) / result.duration)
    assert s["request_throughput"] == pytest.approx(n / result.duration)
    assert s["peak_concurrency"] == 2


def test_tokens_are_counted_from_chunks_without_usage(fake):
    result, s = _run(fake, [[MODES["no_usage"], 5]] * 2)
    assert s["tokens_from"] == "chunks" and s["total_output_tokens"] == 2 * M
    assert s["total_input_tokens"] == 2 * 2  # the workload's prompt lengths
    assert list(result.records["prompt_tokens"]) == [-1, -1]


def test_events_split_across_reads(fake):
    result, s = _run(fake, [[MODES["split"], 5]] * 2)
    assert s["completed"] == 2 and list(result.records["chunks"]) == [M, M]
    assert s["total_output_tokens"] == 2 * M and s["tokens_from"] == "usage"


def test_chat_ttft_waits_for_content(fake):
    """The chat stream's first chunk holds only the role: it is not the first token."""
    result, s = _run(fake, ["hello there"] * 2, endpoint="chat")
    assert s["completed"] == 2 and list(result.records["chunks"]) == [M, M]
    assert np.all(result.records["ttft"] >= FIRST_S)


def test_errors_are_counted_and_the_rest_complete(fake):
    modes = ["http_429", "error_event", "drop"]
    prompts = [[7, 7], *[[MODES[m], 7] for m in modes], [7, 7]]
    result, s = _run(fake, prompts)
    assert s["errors"] == 3 and s["completed"] == 2
    kinds = {e["status"]: e["message"] for e in s["error_kinds"]}
    assert set(kinds) == {429, 500, 0}
    assert kinds[429] == "slow down" and kinds[500] == "engine failed"
    ok = result.records["status"] == 200
    assert list(ok) == [True, False, False, False, True]
    assert list(result.records["chunks"][ok]) == [M, M]
    assert s["total_output_tokens"] == 2 * M  # failed requests' tokens are not throughput
    assert np.all(result.records["ttft"][ok] >= FIRST_S)


def test_poisson_arrivals_have_the_right_mean_gap():
    rate, n = 10.0, 20_001
    a = poisson_arrivals(n, rate, seed=3)
    assert a[0] == 0 and np.all(np.diff(a) >= 0)
    # the mean of n - 1 exponential gaps: mean 1 / rate, standard error (1 / rate) / sqrt(n - 1)
    assert abs(np.diff(a).mean() - 1 / rate) <= 5 / rate / np.sqrt(n - 1)
    assert np.array_equal(a, poisson_arrivals(n, rate, seed=3))
    assert not np.array_equal(a[:10], poisson_arrivals(10, rate, seed=4))
    with pytest.raises(ValueError, match="request rate"):
        poisson_arrivals(3, 0.0)


def test_requests_are_sent_at_their_arrival_times(fake):
    n, rate = 6, 20.0
    result, s = _run(fake, [[1, 2]] * n, request_rate=rate, arrival_seed=5, client_procs=2)
    want = poisson_arrivals(n, rate, seed=5)
    sent = result.records["sent"]
    assert s["completed"] == n and list(result.records["index"]) == list(range(n))
    assert np.all((want <= sent) & (sent <= want + SLACK)), (sent, want)


def test_workload_is_pure_and_the_offline_benchmarks(monkeypatch):
    from kipp_core import bench

    a = random_workload(5, (20, 40), (3, 9), seed=2, vocab=1000)
    assert a == random_workload(5, (20, 40), (3, 9), seed=2, vocab=1000)
    assert a != random_workload(5, (20, 40), (3, 9), seed=3, vocab=1000)
    assert all(20 <= len(w.prompt_token_ids) <= 40 and 3 <= w.max_tokens <= 9 for w in a)
    assert all(0 <= t < 1000 for w in a for t in w.prompt_token_ids)
    warm = random_workload(4, (20, 40), (20, 40), seed=2, warmup=True)
    cold = random_workload(4, (20, 40), (20, 40), seed=2)
    assert all(w.max_tokens <= 16 for w in warm)
    assert not {tuple(w.prompt_token_ids) for w in warm} & {tuple(w.prompt_token_ids) for w in cold}

    seen = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=False):
            seen.append((prompts, [p.max_tokens for p in params]))
            return [type("O", (), {"token_ids": [0] * p.max_tokens})() for p in params]

    r = bench.measure_throughput(FakeLLM(), 7, 20, 40, seed=4)
    items = random_workload(7, (20, 40), (20, 40), seed=4)
    assert seen == [([w.prompt_token_ids for w in items], [w.max_tokens for w in items])]
    assert r["workload_digest"] == workload_digest(items)


def test_cli_run_and_sweep(fake, tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--url", fake.url, "--num-requests", "4", "--vocab", "1000"]
    argv += ["--prompt-len", "3", "--output-len", f"{M}", "--warmup-requests", "1"]
    argv += ["--sweep-rates", "40,80", "--concurrency", "2", "--no-progress", "--json", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["models"]["data"][0]["id"] == "fake-model" == r["model"]
    assert [run["request_rate"] for run in r["runs"]] == [40, 80]
    assert [run["seed"] for run in r["runs"]] == [0, 1]
    items = random_workload(4, (3, 3), (M, M), seed=0, vocab=1000)
    assert r["runs"][0]["workload_digest"] == workload_digest(items)
    for run in r["runs"]:
        assert run["completed"] == 4 and run["total_output_tokens"] == 4 * M
        assert FIRST_S * 1e3 <= run["p99_ttft_ms"] <= (FIRST_S + SLACK) * 1e3
        assert run["concurrency"] == 2 and run["peak_concurrency"] <= 2
    md = capsys.readouterr().out
    assert "| 40 req/s, concurrency 2 | 4 | 0 |" in md and r["command"] in md


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--url", "localhost:8000"], "--url"),
        (["--num-requests", "0"], "--num-requests"),
        (["--concurrency", "0"], "--concurrency"),
        (["--min-len", "9", "--max-len", "3"], "--min-len"),
        (["--prompt-len", "5:2"], "--prompt-len"),
        (["--request-rate", "0"], "--request-rate"),
        (["--sweep-rates", "10,x"], "--sweep-rates"),
        (["--request-rate", "5", "--sweep-rates", "1,2"], "not both"),
        (["--endpoint", "chat", "--prompt-format", "ids"], "text prompts"),
        (["--client-procs", "3", "--num-requests", "2"], "--client-procs"),
        (["--url", "http://127.0.0.1:9"], "cannot read"),
        (["--json", "/no/such/dir/r.json"], "cannot write"),
    ],
)
def test_cli_errors_exit_2_with_one_line(args, says, capsys):
    assert main(["bench", "serve", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and err.startswith("kipp bench serve")


def _samples():
    """(payload bytes, chat) of chunks as kipp's server (its own encoder), compact encoders
    (vLLM, llama-server) and Python's spaced default write them, including text that spells
    the fast path's patterns."""
    from kipp_core.server.streaming import dumps

    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}
    text = [
        {"index": 0, "text": " a", "logprobs": None, "finish_reason": None},
        {"index": 0, "text": "", "logprobs": None, "finish_reason": None},
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"},
        {"index": 0, "text": '"finish_reason":null "usage":{', "finish_reason": "stop"},
    ]
    delta = [
        {"role": "assistant", "content": ""},
        {"content": " b"},
        {"content": '"content":"x'},
        {"reasoning_content": "hm"},
        {},
    ]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    events = [({**head, "choices": [c], "usage": None}, False) for c in text]
    events += [({**head, "choices": [], "usage": usage}, False)]
    events += [({**head, "choices": [text[0]], "usage": usage}, False)]  # vLLM continuous usage
    events += [({"error": {"message": "x", "code": 500}}, False)]
    for d in delta:
        events.append(
            ({**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]}, True)
        )
    out = []
    for ev, chat in events:
        out += [(dumps(ev), chat), (json.dumps(ev).encode(), chat)]
    return out


def test_plain_token_event_agrees_with_parsing():
    """The byte-level shortcut says "token, nothing else" only where the parse says the same,
    and it takes kipp's own token chunks."""
    from kipp_core.loadgen.client import Record, plain_token_event, read_event

    fast_hits = 0
    for payload, chat in _samples():
        rec = Record(0)
        slow = read_event(json.loads(payload), chat, rec)
        if plain_token_event(payload, chat):
            fast_hits += 1
            assert slow and rec.output_tokens is None and rec.error is None, payload
    # kipp's encoder: two completion token chunks and two chat content chunks
    assert fast_hits == 4
