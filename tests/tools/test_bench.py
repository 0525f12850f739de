"""`kipp bench` on the oracle with kipp-tiny: every field is there and positive, the transformers
peer is measured in the same run, and nothing is written after a kernel fell back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kipp_core import fastpath
from kipp_core.checkpoint import Checkpoint
from kipp_core.cli.main import main
from kipp_core.registry import TINY
from kipp_core.tiny import random_checkpoint

TINY_ARGS = ["--backend", "oracle", "--batch-sizes", "1,2", "--prompt-len", "40", "--gen-len", "4"]


@pytest.fixture
def no_fallbacks(monkeypatch):
    """A fresh fallback record (kernel tests elsewhere may have filled the real one)."""
    monkeypatch.setattr(fastpath, "_fallbacks", {})
    assert not fastpath.fallbacks()


def _positive(d: dict, keys) -> None:
    for k in keys:
        assert d[k] > 0, (k, d)


def test_bench_smoke(tiny_path, tmp_path, capsys, no_fallbacks):
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    argv = ["bench", "--model", str(tiny_path), *TINY_ARGS, "--num-requests", "3"]
    argv += ["--min-len", "8", "--max-len", "24", "--prefix-len", "96", "--chat-turns", "3"]
    argv += ["--peers", "transformers", "--json", str(out_json), "--markdown", str(out_md)]
    assert main(argv) == 0
    r = json.loads(out_json.read_text())
    assert [row["batch_size"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        _positive(row, ["prefill_tok_s", "decode_tok_s", "ttft_s", "decode_step_ms"])
        assert len(row["prefill_samples"]) == 3 and row["prefill_tok_s"] in row["prefill_samples"]
        assert row["decode_tokens"] == row["batch_size"] * 3  # all but each first token
    _positive(r["throughput"], ["requests_s", "total_tok_s", "output_tok_s"])
    pc = r["prefix_cache"]
    _positive(pc, ["cold_ttft_s", "warm_ttft_s", "prefix_ttft_s"])
    assert pc["warm_cached_tokens"] == 96  # the oracle keeps hidden states: a prompt-end hit
    assert pc["prefix_cached_tokens"] == 64  # two full blocks; the new last token is computed
    assert [t["turn"] for t in r["chat"]] == [1, 2, 3]
    assert r["chat"][0]["cached_tokens"] == 0 < r["chat"][2]["cached_tokens"]
    _positive(r["memory"], ["peak_memory_bytes"])
    (peer,) = r["peers"]
    assert peer["name"] == "transformers" and len(peer["rows"]) == 2
    _positive(peer["rows"][0], ["prefill_tok_s", "decode_tok_s", "ttft_s"])
    assert r["hardware"]["cpu"] and r["run"]["backend"] == "oracle"
    md = out_md.read_text()
    assert md == capsys.readouterr().out
    assert " ".join(["kipp", *argv]) in md and r["run"]["date"] in md
    assert "| transformers | 2 |" in md and "| kipp | 1 |" in md


def test_prefill_is_the_median_of_its_repeats(monkeypatch):
    """--repeats N times prefill N times and keeps the median run (its TTFT with it)."""
    from kipp_core import bench

    speeds = iter([300.0, 100.0, 200.0])
    monkeypatch.setattr(
        bench,
        "measure_prefill",
        lambda *a: (lambda v: {"prefill_tok_s": v, "ttft_s": 1 / v, "prefill_s": 1 / v})(
            next(speeds)
        ),
    )
    got = bench.median_prefill(None, 8, 1, None, 3)
    assert got["prefill_tok_s"] == 200.0 and got["ttft_s"] == 1 / 200.0
    assert got["prefill_samples"] == [100.0, 200.0, 300.0]


def test_throughput_warmup_is_untimed_and_of_the_same_kind():
    """The warm-up requests come first, from the same length range with at most 16 tokens out;
    only the timed batch's tokens count."""
    from kipp_core import bench

    calls = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=False):
            calls.append(([len(p) for p in prompts], [sp.max_tokens for sp in params]))
            return [type("O", (), {"token_ids": [0] * sp.max_tokens})() for sp in params]

    r = bench.measure_throughput(FakeLLM(), 5, 20, 40, seed=0, warmup=3)
    (wl, wt), (pl, pt) = calls
    assert len(wl) == 3 and all(20 <= n <= 40 for n in wl) and all(t <= 16 for t in wt)
    assert len(pl) == 5 and all(20 <= n <= 40 for n in pl) and max(pt) > 16
    assert r["warmup_requests"] == 3
    assert r["output_tok_s"] * r["seconds"] == pytest.approx(sum(pt))


def test_bench_refuses_to_record_after_a_fallback(tiny_path, tmp_path, capsys, no_fallbacks):
    fastpath.report_fallback("oracle", "fake_matmul", "injected by the test")  # the benched one
    out_json = tmp_path / "b.json"
    argv = ["bench", "--model", str(tiny_path), *TINY_ARGS, "--no-warmup", "--json", str(out_json)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "refusing to record" in err and "oracle/fake_matmul" in err
    assert not out_json.exists()


def test_kernels_needs_a_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    p = subprocess.run(
        [sys.executable, "-m", "kipp_core.cli.main", "bench", "--kernels"],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2
    assert p.stderr.strip() == "kipp bench: error: --kernels needs a CUDA GPU, and none is visible"


@pytest.mark.parametrize("use_torch", [True, False])
def test_random_checkpoint(tmp_path, monkeypatch, use_torch):
    if not use_torch:
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a)
        )
    path = random_checkpoint("kipp-tiny", tmp_path / "r", dtype="float32", seed=3)
    ck = Checkpoint(path)
    assert ck.entry is TINY
    q = ck.get("model.layers.0.self_attn.q_proj.weight")
    assert abs(q.std() * np.sqrt(TINY.config.hidden_size) - 1) < 0.05  # N(0, 1/fan_in)
    norm = ck.get("model.norm.weight")
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.2
    emb = ck.get("model.embed_tokens.weight")
    assert not emb[151669:].any() and abs(emb[:1000].std() - 0.3) < 0.02
    with pytest.raises(ValueError, match="--force"):
        random_checkpoint("kipp-tiny", tmp_path / "r")


def test_make_checkpoint_script(tmp_path):
    script = Path(__file__).resolve().parents[2] / "tools" / "make_checkpoint.py"
    run = [sys.executable, str(script), "--shape", "kipp-tiny"]
    p = subprocess.run([*run, "--out", str(tmp_path / "c")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert Checkpoint(tmp_path / "c").config.hidden_size == TINY.config.hidden_size
    p = subprocess.run([*run, "--out", str(tmp_path / "c")], capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--force" in p.stderr
    p = subprocess.run([*run[:-1], "nope", "--out", "x"], capture_output=True, text=True)
    assert p.returncode == 2 and "unknown shape" in p.stderr


def test_mlx_lm_peer(tiny_path):
    import importlib.util

    if importlib.util.find_spec("mlx_lm") is None or importlib.util.find_spec("kipp_mlx") is None:
        pytest.skip("mlx-lm or kipp_mlx is not installed")
    from kipp_core.bench import BenchSpec, run_peer

    r = run_peer(
        "mlx-lm", tiny_path, BenchSpec(batch_sizes=[1], prompt_len=24, gen_len=4), None, "cpu"
    )
    if "skipped" in r:
        pytest.skip(r["skipped"])
    (row,) = r["rows"]
    assert row["batch_size"] == 1 and row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0


def test_context_rows_with_yarn(tiny_path, tmp_path, no_fallbacks):
    """The H200 long-context run (8B with YaRN at 32,768 and 131,072) in kipp-tiny's shape on the
    oracle (the cuda backend's CPU path falls back, and the bench then refuses to record): YaRN
    from --rope-scaling, rows at each context up to max_model_len."""
    out = tmp_path / "ctx.json"
    argv = ["bench", "--model", str(tiny_path), "--backend", "oracle", "--batch-sizes", "1"]
    argv += ["--prompt-len", "16", "--gen-len", "3", "--repeats", "1", "--no-warmup"]
    argv += ["--rope-scaling", '{"rope_type": "yarn", "factor": 2.0}', "--max-model-len", "1024"]
    argv += ["--context-lens", "300,1024", "--json", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    rows = r["rows"][1:]
    assert [(x["context_len"], x["prompt_len"], x["decode_prompt_len"]) for x in rows] == [
        (300, 300, 300),
        (1024, 1023, 1021),  # room for the output tokens at max_model_len
    ]
    for row in rows:
        _positive(row, ["prefill_tok_s", "decode_tok_s", "ttft_s"])
        assert row["decode_tokens"] == 2
    assert r["rope"] == (
        "RoPE: static YaRN (theta 1e+06), factor 2 over 4,096 positions, a 8,192-token context"
    )


def test_context_lens_past_max_model_len_exit_2(tiny_path, capsys, monkeypatch):
    # a kernel of another backend that fell back earlier in this process does not stop the run
    from kipp_core import fastpath

    monkeypatch.setattr(fastpath, "_fallbacks", {("mlx", "swiglu"): "no GPU"})
    argv = ["bench", "--model", str(tiny_path), "--backend", "oracle", "--context-lens", "5000"]
    assert main([*argv, "--gen-len", "2", "--repeats", "1", "--no-warmup"]) == 2
    assert "--context-lens 5000 is past max_model_len 4096" in capsys.readouterr().err


def test_a_cpu_run_of_a_kernel_backend_is_refused_before_it_runs(
    tiny_path, capsys, no_fallbacks, monkeypatch
):
    """--backend mlx on a CPU falls back to its kernels' references: refused after one warm-up
    step (not after the whole benchmark), in one line that offers --allow-fallback, which
    records the run labelled as a fallback run."""
    pytest.importorskip("mlx")
    import mlx.core as mx

    if mx.default_device() == mx.gpu:
        pytest.skip("a GPU runs the MLX kernels")
    from kipp_core import bench

    ran, real = [], bench.run_benchmarks
    monkeypatch.setattr(bench, "run_benchmarks", lambda *a: ran.append(1) or real(*a))
    bench_args = ["--batch-sizes", "1", "--prompt-len", "8", "--gen-len", "2", "--repeats", "1"]
    argv = ["bench", "--model", str(tiny_path), "--backend", "mlx", *bench_args, "--no-warmup"]
    assert main(argv) == 2
    assert not ran
    err = capsys.readouterr().err
    assert "refusing to record" in err and "--allow-fallback" in err
    assert main([*argv, "--allow-fallback"]) == 0
    out = capsys.readouterr().out
    assert "FALLBACK RUN" in out and "fallback run: kernels ran their reference paths" in out
