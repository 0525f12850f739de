"""Benchmarks through `LLM`, the same on every backend: prefill and decode tok/s, time to first
token, offline throughput, prefix-cache and multi-turn chat TTFT, peak memory. Results are plain
dicts, written as JSON and as a markdown table by `kipp bench`.

Prompts are random token ids from the ordinary vocabulary, fresh for every measurement, so the
prefix cache never serves a measurement that is meant to compute.
"""

from __future__ import annotations

import importlib
import os
import platform
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kipp_core.sampling import SamplingParams
from kipp_core.workload import (  # noqa: F401 (MAX_ORDINARY_ID: peers import it from here)
    MAX_ORDINARY_ID,
    random_workload,
    workload_digest,
)


@dataclass
class BenchSpec:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    prompt_len: int = 512
    gen_len: int = 128
    warmup: bool = True  # run every shape once before timing it (JIT, graph capture, autotune)
    repeats: int = 3  # prefill is timed this many times, the median counts (hosts are noisy)
    num_requests: int = 0  # offline throughput requests (0 skips it); vLLM uses 256 ...
    min_len: int = 100  # ... with prompt and output lengths uniform in [100, 1024]
    max_len: int = 1024
    prefix_len: int = 0  # prefix-cache cold/warm TTFT at this prompt length (0 skips it)
    chat_turns: int = 0  # multi-turn chat TTFT (0 skips it)
    context_lens: list[int] = field(default_factory=list)  # batch-1 long-context rows
    seed: int = 0


def random_prompts(n: int, length: int, rng: np.random.Generator) -> list[list[int]]:
    return rng.integers(0, MAX_ORDINARY_ID, size=(n, length)).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def measure_prefill(llm, prompt_len: int, batch_size: int, rng) -> dict:
    """B prompts of P tokens, one output token each: prefill tok/s and the mean TTFT."""
    prompts = random_prompts(batch_size, prompt_len, rng)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, greedy(1), use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {
        "prefill_tok_s": batch_size * prompt_len / seconds,
        "ttft_s": float(np.mean([o.metrics.ttft for o in outs])),
        "prefill_s": seconds,
    }


def median_prefill(llm, prompt_len: int, batch_size: int, rng, repeats: int) -> dict:
    """measure_prefill `repeats` times on new prompts: the run with the median tok/s, and every
    run's tok/s under "prefill_samples"."""
    runs = sorted(
        (measure_prefill(llm, prompt_len, batch_size, rng) for _ in range(repeats)),
        key=lambda r: r["prefill_tok_s"],
    )
    return {**runs[len(runs) // 2], "prefill_samples": [r["prefill_tok_s"] for r in runs]}


def measure_decode(llm, batch_size: int, prompt_len: int, gen_len: int, rng) -> dict:
    """B requests of G tokens; decode tok/s counts the tokens made after every request has its
    first one, over the time since then."""
    engine = llm.engine
    ids = [uuid.uuid4().hex for _ in range(batch_size)]
    for rid, p in zip(ids, random_prompts(batch_size, prompt_len, rng)):
        engine.add_request(rid, p, greedy(gen_len))
    counts = dict.fromkeys(ids, 0)
    t1 = None
    made_at_t1 = steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
        if t1 is None:
            if min(counts.values()) > 0:
                t1, made_at_t1 = time.perf_counter(), sum(counts.values())
        else:
            steps += 1
    seconds = time.perf_counter() - t1
    made = sum(counts.values()) - made_at_t1
    return {
        "decode_tok_s": made / seconds if seconds > 0 else float("nan"),
        "decode_step_ms": 1000 * seconds / max(steps, 1),
        "decode_tokens": made,
    }


def measure_throughput(
    llm, num_requests: int, min_len: int, max_len: int, seed: int = 0, warmup: int = 0
) -> dict:
    """vLLM's benchmark_throughput: N requests with random prompt and output lengths at once, the
    workload `kipp bench serve` sends a server with the same seed (kipp_core.workload).
    `warmup` requests of the same kind (at most 16 tokens out) run first, untimed: they compile
    the Triton kernel variants that mixed prefill and decode steps of random lengths first meet,
    which vLLM does at start-up (about 2 s of a 0.6B run on the H200, benchmarks/LOG.md)."""
    lens = (min_len, max_len)
    if warmup:
        items = random_workload(warmup, lens, lens, seed, warmup=True)
        llm.generate(
            [w.prompt_token_ids for w in items],
            [greedy(w.max_tokens) for w in items],
            use_tqdm=False,
        )
    items = random_workload(num_requests, lens, lens, seed)
    t0 = time.perf_counter()
    outs = llm.generate(
        [w.prompt_token_ids for w in items], [greedy(w.max_tokens) for w in items], use_tqdm=False
    )
    seconds = time.perf_counter() - t0
    out_tokens = sum(len(o.token_ids) for o in outs)
    total = out_tokens + sum(len(w.prompt_token_ids) for w in items)
    return {
        "num_requests": num_requests,
        "requests_s": num_requests / seconds,
        "total_tok_s": total / seconds,
        "output_tok_s": out_tokens / seconds,
        "seconds": seconds,
        "warmup_requests": warmup,
        "workload_digest": workload_digest(items),
    }


def measure_prefix_cache(llm, prompt_len: int, rng, repeats: int = 10) -> dict:
    """TTFT of one long prompt computed cold, then served by the cache (median of `repeats`):
    the same prompt again (a prompt-end hit where the backend keeps hidden states: no layer
    runs), and the same prompt with a new last token (its full blocks hit, the rest computed)."""
    # A first pair on another prompt compiles the kernels both paths use (e.g. short queries
    # over a long cached context), so neither measured number contains compilation.
    other = random_prompts(1, prompt_len, rng)[0]
    for last in (other[-1], other[-1] + 1, other[-1]):
        llm.generate([other[:-1] + [last]], greedy(1), use_tqdm=False)
    prompt = random_prompts(1, prompt_len, rng)[0]
    cold = llm.generate([prompt], greedy(1), use_tqdm=False)[0].metrics
    warm = [llm.generate([prompt], greedy(1), use_tqdm=False)[0].metrics for _ in range(repeats)]
    vocab = llm.engine.model_config.vocab_size
    edited = [prompt[:-1] + [(prompt[-1] + 1 + i) % vocab] for i in range(repeats)]
    prefix = [llm.generate([p], greedy(1), use_tqdm=False)[0].metrics for p in edited]
    warm_s = float(np.median([m.ttft for m in warm]))
    prefix_s = float(np.median([m.ttft for m in prefix]))
    return {
        "prompt_len": prompt_len,
        "cold_ttft_s": cold.ttft,
        "warm_ttft_s": warm_s,
        "warm_cached_tokens": warm[0].num_cached_tokens,
        "speedup": cold.ttft / warm_s,
        "warm_ttft_samples_s": [m.ttft for m in warm],
        "prefix_ttft_s": prefix_s,
        "prefix_cached_tokens": prefix[0].num_cached_tokens,
        "prefix_speedup": cold.ttft / prefix_s,
    }


def cold_ttft(llm, prompt_token_ids: list[int]) -> float:
    """TTFT of a prompt computed in full, with the prefix cache off (and left untouched)."""
    bm = llm.engine.block_manager
    was, bm.enable_prefix_caching = bm.enable_prefix_caching, False
    try:
        return llm.generate([prompt_token_ids], greedy(1), use_tqdm=False)[0].metrics.ttft
    finally:
        bm.enable_prefix_caching = was


def measure_chat_turns(
    llm, num_turns: int, user_words: int = 40, reply_len: int = 64, seed: int = 0
) -> list[dict]:
    """`kipp chat` turns: per turn the history length, the tokens the prefix cache served, the
    TTFT, and the TTFT of computing the same prompt in full (what re-rendering would cost)."""
    from kipp_core.cli.chat import ChatSession

    rng = np.random.default_rng(seed)
    words = ["sea", "stone", "light", "river", "green", "window", "paper", "north", "salt"]
    session = ChatSession(
        llm, enable_thinking=False, max_tokens=reply_len, temperature=0.0, ignore_eos=True
    )
    rows = []
    for i in range(num_turns):
        user = " ".join(rng.choice(words, size=user_words))
        cold = cold_ttft(llm, session.prompt_token_ids(user))
        m = session.turn(user).metrics
        rows.append(
            {
                "turn": i + 1,
                "history_tokens": m.num_prompt_tokens,
                "cached_tokens": m.num_cached_tokens,
                "computed_tokens": m.num_prompt_tokens - m.num_cached_tokens,
                "ttft_s": m.ttft,
                "full_prompt_ttft_s": cold,
            }
        )
    return rows


def peak_memory(llm) -> dict:
    """Peak device memory on cuda/mlx; the process's peak RSS otherwise."""
    if llm.backend_name == "cuda":
        import torch

        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated()), "kind": "cuda"}
    if llm.backend_name == "mlx":
        import mlx.core as mx

        return {"peak_memory_bytes": int(mx.get_peak_memory()), "kind": "mlx"}
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_memory_bytes": rss if sys.platform == "darwin" else rss * 1024, "kind": "rss"}


def host() -> dict:
    """This machine's CPU and platform."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform()}


def hardware() -> dict:
    """host() and the visible GPUs."""
    gpu = None
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return {**host(), "gpu": gpu}


def run_benchmarks(llm, spec: BenchSpec, log=print) -> dict:
    """Every measurement of `spec` on `llm`: the result dict (bench_report.to_markdown shows it)."""
    from tqdm import tqdm

    from kipp_core.bench_context import context_rows, rope_line

    rng = np.random.default_rng(spec.seed)
    parts = [bool(spec.num_requests), bool(spec.prefix_len), bool(spec.chat_turns)]
    parts.append(bool(spec.context_lens))
    bar = tqdm(total=len(spec.batch_sizes) + sum(parts), desc="bench", disable=None, leave=False)
    rows = []
    for b in spec.batch_sizes:
        for _ in range(2 if spec.warmup else 1):  # the last run counts
            pre = median_prefill(llm, spec.prompt_len, b, rng, spec.repeats)
            dec = measure_decode(llm, b, spec.prompt_len, spec.gen_len, rng)
        rows.append(
            {"batch_size": b, "prompt_len": spec.prompt_len, "gen_len": spec.gen_len, **pre, **dec}
        )
        bar.update()
        log(
            f"batch {b}: prefill {pre['prefill_tok_s']:.1f} tok/s, decode "
            f"{dec['decode_tok_s']:.1f} tok/s, ttft {pre['ttft_s'] * 1000:.1f} ms"
        )
    if spec.context_lens:
        rows += context_rows(
            llm, spec.context_lens, spec.gen_len, rng, spec.repeats, spec.warmup, log
        )
        bar.update()
    result = {"spec": asdict(spec), "rows": rows, "rope": rope_line(llm.config)}
    if spec.num_requests:
        result["throughput"] = measure_throughput(
            llm,
            spec.num_requests,
            spec.min_len,
            spec.max_len,
            spec.seed,
            warmup=min(16, spec.num_requests) if spec.warmup else 0,
        )
        bar.update()
    if spec.prefix_len:
        result["prefix_cache"] = measure_prefix_cache(llm, spec.prefix_len, rng)
        bar.update()
    if spec.chat_turns:
        result["chat"] = measure_chat_turns(llm, spec.chat_turns, seed=spec.seed)
        bar.update()
    bar.close()
    result["memory"] = peak_memory(llm)
    return result


# -- peers --------------------------------------------------------------------------------------

# Peer engines measured in the same run: module -> the backend whose device they share. Each module
# has `measure(model_path, *, batch_sizes, prompt_len, gen_len, dtype, seed) -> dict` with "name",
# "version" and "rows" of {batch_size, prefill_tok_s, decode_tok_s, ttft_s}.
PEERS = {"transformers": "kipp_cuda.peer", "mlx-lm": "kipp_mlx.peer"}


def run_peer(
    name: str, model_path, spec: BenchSpec, dtype: str | None, device: str, quant: str | None = None
) -> dict:
    """Measure one peer; {"name", "skipped": reason} when it is not installed or has no helper.
    mlx-lm quantizes the float checkpoint as `quant` asks and runs the throughput workload too."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}: choose from {', '.join(PEERS)}")
    pkg = {"transformers": "transformers", "mlx-lm": "mlx_lm"}[name]
    if importlib.util.find_spec(pkg) is None:
        return {"name": name, "skipped": f"{pkg} is not installed"}
    try:
        module = importlib.import_module(PEERS[name])
    except ImportError as e:
        return {"name": name, "skipped": f"{PEERS[name]} cannot be imported: {e}"}
    kw = dict(
        batch_sizes=spec.batch_sizes,
        prompt_len=spec.prompt_len,
        gen_len=spec.gen_len,
        dtype=dtype,
        seed=spec.seed,
    )
    if name == "transformers":
        kw["device"] = device
        if quant is not None:
            return {"name": name, "skipped": f"the transformers peer runs no {quant!r} weights"}
    else:
        kw.update(
            quant=quant,
            num_requests=spec.num_requests,
            min_len=spec.min_len,
            max_len=spec.max_len,
        )
    if hasattr(module, "measure"):
        return module.measure(str(model_path), **kw)
    return {"name": name, "skipped": f"{PEERS[name]} has no measure()"}


# -- markdown -----------------------------------------------------------------------------------


def check_no_fallbacks(allow: bool = False, backend: str | None = None) -> list[str]:
    """The kernels of `backend` (default: every backend) that fell back to their reference
    paths in this process; unless `allow` (--allow-fallback: the run is recorded, labelled as
    one), a ValueError listing them."""
    from kipp_core.fastpath import fallbacks

    fb = [
        f"{b}/{k}: {why}"
        for (b, k), why in sorted(fallbacks().items())
        if backend is None or b == backend
    ]
    if fb and not allow:
        raise ValueError(
            f"refusing to record: kernels fell back to reference paths ({'; '.join(fb)}); "
            "--allow-fallback records the run, labelled as a fallback run"
        )
    return fb
