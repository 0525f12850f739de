"""Tensor-parallel gate on real shapes: TP=2 logits equal TP=1 within bf16 tolerance, and greedy
tokens are equal in float32. python tools/gates/tp_gate.py --shape qwen3-8b"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import torch

from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from kipp_core.tiny import random_checkpoint


def run(path, dtype, tp, prompt, n):
    llm = LLM(
        str(path),
        backend="cuda",
        dtype=dtype,
        tensor_parallel=tp,
        kv_cache_memory="8GiB",
        max_model_len=8192,
        max_num_seqs=8,
    )
    logits = llm.logits(prompt)
    toks = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[
        0
    ].token_ids
    if tp > 1:
        llm.backend.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return logits, toks


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    path = random_checkpoint(args.shape)
    prompt = np.random.default_rng(0).integers(0, 151000, size=300).tolist()
    for dtype in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        l1, t1 = run(path, dtype, 1, prompt, args.tokens)
        print(f"== {dtype} TP=1 done in {time.perf_counter() - t0:.0f} s", flush=True)
        l2, t2 = run(path, dtype, 2, prompt, args.tokens)
        print(f"== {dtype} TP=2 done in {time.perf_counter() - t0:.0f} s", flush=True)
        d = l1.astype(np.float64) - l2
        nmse = float(np.mean(d**2) / np.mean(l1.astype(np.float64) ** 2))
        rel = float(np.linalg.norm(d) / np.linalg.norm(l1))
        first = next((i for i, (a, b) in enumerate(zip(t1, t2)) if a != b), None)
        print(
            f"{args.shape} {dtype}: TP2 vs TP1 logits rel err {rel:.2e}, NMSE {nmse:.2e}; "
            f"greedy tokens equal for {args.tokens}: {t1 == t2} (first mismatch at {first})"
        )


if __name__ == "__main__":
    main()
