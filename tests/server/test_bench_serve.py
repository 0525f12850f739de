"""`kipp bench serve` against the real server on kipp-tiny (oracle): every request completes with
exactly its requested number of tokens, and the generator's token counts equal the server's own
Prometheus counters."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kipp_core.cli.main import main
from kipp_core.workload import random_workload
from tests.server.conftest import Http, wait_idle


def _counter(server, name: str) -> float:
    _, _, text = Http(server.url).get("/metrics")
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_against_kipp_serve(server, tmp_path, endpoint):
    out = tmp_path / "r.json"
    n, lens, outs, warm = 4, (8, 24), (3, 9), 2
    argv = ["bench", "serve", "--url", server.url, "--endpoint", endpoint, "--no-progress"]
    argv += ["--num-requests", str(n), "--prompt-len", "8:24", "--output-len", "3:9"]
    argv += ["--concurrency", "2", "--warmup-requests", str(warm), "--seed", "7"]
    argv += ["--json", str(out)]
    before = _counter(server, "kipp_generation_tokens_total")
    prompt_before = _counter(server, "kipp_prompt_tokens_total")
    assert main(argv) == 0
    wait_idle(server)
    (run,) = json.loads(out.read_text())["runs"]
    items = random_workload(n, lens, outs, seed=7)
    want = sum(w.max_tokens for w in items)
    assert run["completed"] == n and run["errors"] == 0 and run["tokens_from"] == "usage"
    assert run["total_output_tokens"] == want and run["length_mismatches"] == 0
    warm_tokens = sum(w.max_tokens for w in random_workload(warm, lens, outs, seed=7, warmup=True))
    assert _counter(server, "kipp_generation_tokens_total") - before == want + warm_tokens
    served_prompt = _counter(server, "kipp_prompt_tokens_total") - prompt_before
    if endpoint == "completions":  # token-id prompts arrive as they are
        assert run["total_input_tokens"] == sum(len(w.prompt_token_ids) for w in items)
    assert run["total_input_tokens"] < served_prompt  # the warm-up's prompts count there too
    for key in ("median_ttft_ms", "p99_itl_ms", "mean_tpot_ms"):
        assert run[key] > 0


def test_serving_overhead_bench_counts_every_token(tiny_path):
    """kipp_core.server.bench (the README's served / offline figure) drives its served phase
    through the load generator: 3 clients x 4 tokens each side."""
    from kipp_core.llm import LLM
    from kipp_core.server import bench

    r = bench.run(LLM(str(tiny_path)), num_clients=3, prompt_len=8, max_tokens=4, repeats=1)
    assert [n for n, _ in r["offline_runs"]] == [12] == [n for n, _ in r["served_runs"]]
    assert r["ratio"] == r["served_tok_s"] / r["offline_tok_s"] > 0
