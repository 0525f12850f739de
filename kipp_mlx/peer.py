"""The benchmark peer: mlx-lm on the same checkpoint directory, timed as kipp_mlx.bench times us.

mlx_lm.load reads the same safetensors; generation runs mlx-lm's own pipeline
(`mlx_lm.generate.generate_step`: chunked prefill that evaluates only the cache, then the last
prompt token's logits, then one asynchronously pipelined step per token, with its own KV cache).
Prefill is the time to the first token; decode is tokens per second after it; medians over
repeats after a warm-up. `measure` is the peer protocol of `kipp bench` (kipp_core.bench.PEERS).
"""

from __future__ import annotations

import statistics
import time

from kipp_mlx import bench


class PeerRunner:
    """One timed greedy generation per `run()` with mlx-lm, cast to `dtype` when given."""

    def __init__(
        self,
        model: str,
        prompt_len: int = 128,
        decode_tokens: int = 16,
        dtype: str | None = None,
        seed: int = 0,
    ):
        import mlx.core as mx
        from mlx_lm import load

        self.model, _ = load(str(model))
        if dtype is not None:
            self.model.set_dtype(getattr(mx, dtype))
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


def bench_mlx_lm(
    model: str,
    prompt_len: int = 128,
    decode_tokens: int = 16,
    repeats: int = 3,
    dtype: str | None = None,
) -> dict:
    """Median prefill and decode tok/s of mlx-lm at batch 1, greedy."""
    return bench.measure(PeerRunner(model, prompt_len, decode_tokens, dtype), repeats)


def measure(
    model_path: str,
    *,
    batch_sizes: list[int],
    prompt_len: int,
    gen_len: int,
    dtype: str | None = None,
    seed: int = 0,
    repeats: int = 2,
) -> dict:
    """`kipp bench`'s peer protocol: prefill tok/s, decode tok/s (the gen_len - 1 tokens after the
    first) and TTFT. Batch 1 only: mlx-lm's generate_step runs one stream."""
    import mlx.core as mx
    import mlx_lm

    runner = PeerRunner(model_path, prompt_len, max(gen_len - 1, 0), dtype, seed)
    runner.run()  # warm-up
    runs = [runner.run() for _ in range(repeats)]
    pre = statistics.median(p for p, _ in runs)
    dec = statistics.median(d for _, d in runs)
    row = {
        "batch_size": 1,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "prefill_tok_s": prompt_len / pre,
        "decode_tok_s": (gen_len - 1) / dec if gen_len > 1 else None,
        "ttft_s": pre,
    }
    skipped = [b for b in batch_sizes if b != 1]
    return {
        "name": "mlx-lm",
        "version": mlx_lm.__version__,
        "dtype": dtype or "as stored",
        "device": str(mx.default_device()),
        "rows": [row] if 1 in batch_sizes else [],
        "note": f"batch 1 only (mlx-lm generates one stream); not run: {skipped}"
        if skipped
        else "batch 1",
    }
