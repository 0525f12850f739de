"""The benchmark peer: mlx-lm on the same checkpoint directory, timed as kipp_mlx.bench times us.

mlx_lm.load reads the same safetensors; generation runs mlx-lm's own pipeline
(`mlx_lm.generate.generate_step`: chunked prefill that evaluates only the cache, then the last
prompt token's logits, then one asynchronously pipelined step per token, with its own KV cache);
batches and the offline throughput run mlx-lm's continuous batching (`BatchGenerator`).
Prefill is the time to the first token; decode is tokens per second after it; medians over
repeats after a warm-up. `measure` is the peer protocol of `kipp bench` (kipp_core.bench.PEERS).
"""

from __future__ import annotations

import statistics
import time

from kipp_mlx import bench


class PeerRunner:
    """One timed greedy generation per `run()` with mlx-lm, cast to `dtype` when given and
    quantized as `quant` asks (mlx-lm's nn.quantize, group 32)."""

    def __init__(
        self,
        model: str,
        prompt_len: int = 128,
        decode_tokens: int = 16,
        dtype: str | None = None,
        seed: int = 0,
        quant: str | None = None,
    ):
        import mlx.core as mx

        self.model = load_peer(model, dtype, quant)
        self.prompt = mx.array(bench.random_prompt(prompt_len, seed))
        self.prompt_len, self.decode_tokens = prompt_len, decode_tokens

    def run(self) -> tuple[float, float]:
        from mlx_lm.generate import generate_step

        t0 = time.perf_counter()
        gen = generate_step(self.prompt, self.model, max_tokens=self.decode_tokens + 1)
        next(gen)
        t1 = time.perf_counter()
        n = sum(1 for _ in gen)
        assert n == self.decode_tokens
        return t1 - t0, time.perf_counter() - t1


QUANT_BITS = {"affine4": 4, "affine8": 8}


def load_peer(model: str, dtype: str | None = None, quant: str | None = None):
    """mlx-lm's model for the folder, in `dtype`, quantized for `quant` as mlx-lm users do."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm import load

    m, _ = load(str(model))
    if dtype is not None:
        m.set_dtype(getattr(mx, dtype))
    if quant is not None:
        if quant not in QUANT_BITS:
            raise ValueError(f"the mlx-lm peer quantizes affine4 or affine8, not {quant!r}")
        nn.quantize(m, group_size=32, bits=QUANT_BITS[quant])
        mx.eval(m.parameters())
    return m


def generate_batch(model, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    """mlx-lm's continuous batching (BatchGenerator) over every prompt at once, greedy, with no
    stop tokens: wall time, output tokens, and the decode rate once every request has its first
    token (kipp_core.bench.measure_decode's definition)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model, stop_tokens=None, completion_batch_size=len(prompts), prefill_batch_size=8
    )
    t0 = time.perf_counter()
    gen.insert(prompts, max_tokens)
    first: set[int] = set()
    tokens, after, t_all = 0, 0, None
    while responses := gen.next_generated():
        for r in responses:
            tokens += 1
            if r.uid not in first:
                first.add(r.uid)
            elif t_all is not None:
                after += 1
        if t_all is None and len(first) == len(prompts):
            t_all = time.perf_counter()
    end = time.perf_counter()
    gen.close()
    return {
        "seconds": end - t0,
        "output_tokens": tokens,
        "decode_tok_s": after / (end - t_all) if t_all is not None and end > t_all else None,
        "ttft_s": (t_all - t0) if t_all is not None else None,
    }


def bench_mlx_lm(
    model: str,
    prompt_len: int = 128,
    decode_tokens: int = 16,
    repeats: int = 3,
    dtype: str | None = None,
    quant: str | None = None,
) -> dict:
    """Median prefill and decode tok/s of mlx-lm at batch 1, greedy."""
    return bench.measure(PeerRunner(model, prompt_len, decode_tokens, dtype, quant=quant), repeats)


def measure(
    model_path: str,
    *,
    batch_sizes: list[int],
    prompt_len: int,
    gen_len: int,
    dtype: str | None = None,
    seed: int = 0,
    repeats: int = 2,
    quant: str | None = None,
    num_requests: int = 0,
    min_len: int = 100,
    max_len: int = 1024,
) -> dict:
    """`kipp bench`'s peer protocol: prefill tok/s, decode tok/s (the gen_len - 1 tokens after the
    first) and TTFT per batch size (1: generate_step, as mlx_lm.generate; more: BatchGenerator),
    and, with num_requests, the offline throughput of kipp_core.workload's workload."""
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    from kipp_core.workload import random_workload

    runner = PeerRunner(model_path, prompt_len, max(gen_len - 1, 0), dtype, seed, quant)
    rows = []
    if 1 in batch_sizes:
        runner.run()  # warm-up
        runs = [runner.run() for _ in range(repeats)]
        pre = statistics.median(p for p, _ in runs)
        dec = statistics.median(d for _, d in runs)
        rows.append(
            {
                "batch_size": 1,
                "prompt_len": prompt_len,
                "gen_len": gen_len,
                "prefill_tok_s": prompt_len / pre,
                "decode_tok_s": (gen_len - 1) / dec if gen_len > 1 else None,
                "ttft_s": pre,
            }
        )
    rng = np.random.default_rng(seed)
    for b in [b for b in batch_sizes if b != 1]:
        prompts = rng.integers(0, bench.VOCAB, size=(b, prompt_len)).tolist()
        generate_batch(runner.model, prompts[: min(b, 8)], [4] * min(b, 8))  # warm-up
        r = generate_batch(runner.model, prompts, [gen_len] * b)
        rows.append(
            {
                "batch_size": b,
                "prompt_len": prompt_len,
                "gen_len": gen_len,
                "prefill_tok_s": b * prompt_len / r["ttft_s"] if r["ttft_s"] else None,
                "decode_tok_s": r["decode_tok_s"],
                "ttft_s": r["ttft_s"],
            }
        )
    out = {
        "name": "mlx-lm",
        "version": mlx_lm.__version__,
        "dtype": dtype or "as stored",
        "quant": quant,
        "device": str(mx.default_device()),
        "rows": rows,
        "note": "batch 1: generate_step; batches: BatchGenerator (continuous batching)",
    }
    if num_requests:
        lens = (min_len, max_len)
        items = random_workload(num_requests, lens, lens, seed)
        r = generate_batch(
            runner.model, [w.prompt_token_ids for w in items], [w.max_tokens for w in items]
        )
        out["throughput"] = {
            "num_requests": num_requests,
            "output_tok_s": r["output_tokens"] / r["seconds"],
            "seconds": r["seconds"],
            "output_tokens": r["output_tokens"],
        }
    return out
