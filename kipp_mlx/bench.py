"""Prefill and decode throughput of the MLX backend through kipp_core.llm.LLM, batch 1.

Prefill: the time of the engine step that runs a P-token prompt and samples its first token.
Decode: generated tokens per second over the steps after it. Both are medians over repeats, after a
warm-up run; prefix caching is off so every repeat computes its prompt. kipp_mlx.peer measures
mlx-lm the same way; `compare` alternates the runners repeat by repeat, so load from other
processes falls on both alike.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

VOCAB = 151_000  # prompt ids are drawn below this: ordinary text tokens


def random_prompt(num_tokens: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=num_tokens).tolist()


def summarize(runs: list[tuple[float, float]], prompt_len: int, decode_tokens: int) -> dict:
    """runs: (prefill seconds, decode seconds) per repeat."""
    return {
        "prefill_tok_s": statistics.median(prompt_len / p for p, _ in runs),
        "decode_tok_s": statistics.median(decode_tokens / d for _, d in runs),
        "prefill_s": [p for p, _ in runs],
        "decode_s": [d for _, d in runs],
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
    }


class KippRunner:
    """One timed generation per `run()` on `LLM(model, backend="mlx")`."""

    def __init__(
        self,
        model: str,
        prompt_len: int = 128,
        decode_tokens: int = 16,
        dtype: str | None = None,
        **llm_kw,
    ):
        from kipp_core.llm import LLM
        from kipp_core.sampling import SamplingParams

        llm_kw.setdefault("max_model_len", prompt_len + decode_tokens + 64)
        self.llm = LLM(model, backend="mlx", dtype=dtype, enable_prefix_caching=False, **llm_kw)
        self.params = SamplingParams(temperature=0, max_tokens=decode_tokens + 1, ignore_eos=True)
        self.prompt = random_prompt(prompt_len)
        self.prompt_len, self.decode_tokens = prompt_len, decode_tokens
        self._n = 0

    def run(self) -> tuple[float, float]:
        eng = self.llm.engine
        self._n += 1
        eng.add_request(f"bench-{self._n}", self.prompt, self.params)
        t0 = time.perf_counter()
        # the whole prompt (max_num_batched_tokens >= prompt_len) and its first token; with async
        # scheduling the step that queues the prompt returns before its token is known
        while not any(o.outputs[0].token_ids for o in eng.step()):
            pass
        t1 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        return t1 - t0, time.perf_counter() - t1


def measure(runner, repeats: int = 3) -> dict:
    runner.run()  # warm-up
    runs = [runner.run() for _ in range(repeats)]
    return summarize(runs, runner.prompt_len, runner.decode_tokens)


def compare(runners: dict, repeats: int = 3) -> dict[str, dict]:
    """Each runner warmed up, then one repeat of each in turn, `repeats` times."""
    for r in runners.values():
        r.run()
    runs: dict[str, list] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, r in runners.items():
            runs[name].append(r.run())
    return {
        name: summarize(runs[name], r.prompt_len, r.decode_tokens) for name, r in runners.items()
    }


def bench_kipp(
    model: str,
    prompt_len: int = 128,
    decode_tokens: int = 16,
    repeats: int = 3,
    dtype: str | None = None,
    **llm_kw,
) -> dict:
    """Median prefill and decode tok/s of `LLM(model, backend="mlx")` at batch 1."""
    return measure(KippRunner(model, prompt_len, decode_tokens, dtype, **llm_kw), repeats)
