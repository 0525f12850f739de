"""Serving overhead: N concurrent streaming clients on loopback against the same workload run
offline through `LLM.generate` on the same engine.

    python -m kipp_core.server.bench --model kipp-tiny --backend oracle --clients 32

The clients are kipp_core.loadgen's (`kipp bench serve`), in a process of their own, so that they
do not compete with the server for the GIL.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kipp_core.llm import LLM
from kipp_core.loadgen import LoadSpec, run_load, summarize
from kipp_core.sampling import SamplingParams
from kipp_core.server.context import ServerConfig
from kipp_core.server.server import APIServer, ServerThread


def _prompts(num: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=length).tolist() for _ in range(num)]


def _offline(llm: LLM, prompts: list[list[int]], kw: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    # The server starts from the checkpoint's defaults too, so both sides sample alike.
    params = [llm.default_sampling_params(seed=i, **kw) for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


def _served(url: str, prompts: list[list[int]], kw: dict) -> tuple[int, float]:
    spec = LoadSpec(url=url, model=None, temperature=kw["temperature"], progress=False)
    result = run_load(spec, prompts, [kw["max_tokens"]] * len(prompts))
    summary = summarize(result, [len(p) for p in prompts], [kw["max_tokens"]] * len(prompts))
    if summary["errors"]:
        raise RuntimeError(f"served requests failed: {summary['error_kinds']}")
    return summary["total_output_tokens"], result.duration


def run(
    llm: LLM,
    num_clients: int = 32,
    prompt_len: int = 32,
    max_tokens: int = 64,
    temperature: float = 0.0,
    repeats: int = 3,
    seed: int = 0,
) -> dict:
    """Output tokens per second of the same workload offline (`LLM.generate`) and through the
    server (num_clients concurrent streams), on `llm`'s engine. The phases alternate `repeats`
    times and the best of each counts, which keeps other load on the machine out of the ratio;
    every phase gets fresh random prompts of the same length, so none reuses another's prefix
    cache. The server sits idle (its worker blocked) while the offline phases use the engine."""
    vocab = llm.tokenizer.vocab_size
    kw = dict(max_tokens=max_tokens, ignore_eos=True, temperature=temperature)
    llm.generate(
        _prompts(2, prompt_len, seed + 1000, vocab), SamplingParams(**{**kw, "max_tokens": 4})
    )
    server = ServerThread(APIServer(ServerConfig(port=0), llm=llm)).start()
    offline, served = [], []
    try:
        for r in range(repeats):
            prompts = _prompts(num_clients, prompt_len, seed + 2 * r, vocab)
            offline.append(_offline(llm, prompts, kw))
            prompts = _prompts(num_clients, prompt_len, seed + 2 * r + 1, vocab)
            served.append(_served(server.url, prompts, kw))
    finally:
        server.stop()
    offline_tps = max(n / s for n, s in offline)
    served_tps = max(n / s for n, s in served)
    return {
        "num_clients": num_clients,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "offline_runs": [(n, round(s, 3)) for n, s in offline],
        "served_runs": [(n, round(s, 3)) for n, s in served],
        "offline_tok_s": offline_tps,
        "served_tok_s": served_tps,
        "ratio": served_tps / offline_tps,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kipp-tiny")
    p.add_argument("--backend", default="oracle")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    llm = LLM(args.model, backend=args.backend)
    r = run(llm, args.clients, args.prompt_len, args.max_tokens, args.temperature, args.repeats)
    print(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
