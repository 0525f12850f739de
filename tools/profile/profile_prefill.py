"""Where an eager prefill step's host time goes on the CUDA backend: cProfile of a cold prompt and
of a prefix-cache hit, then torch.profiler's CPU and GPU tables of the cold one.

python tools/profile/profile_prefill.py --shape qwen3-0.6b --prompt-len 2048 --prefix-len 6890
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from kipp_core.llm import LLM
from kipp_core.sampling_params import SamplingParams
from kipp_core.tiny import random_checkpoint


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--prefix-len", type=int, default=6890)
    args = p.parse_args()
    llm = LLM(
        str(random_checkpoint(args.shape)), backend="cuda", kv_cache_memory="16GiB", max_num_seqs=32
    )
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)

    def prompt(n):
        return rng.integers(0, 150000, n).tolist()

    def run(p):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate([p], sp, use_tqdm=False)[0]
        torch.cuda.synchronize()
        return time.perf_counter() - t, out.metrics.ttft

    for n in (args.prompt_len, args.prefix_len):  # compile every path first
        q = prompt(n)
        run(q), run(q)
    long = prompt(args.prefix_len)
    for name, p in (("cold", prompt(args.prompt_len)), ("cold", long), ("warm", long)):
        wall, ttft = run(p)
        print(f"{name} {len(p)}: wall {wall * 1e3:.2f} ms ttft {ttft * 1e3:.2f} ms")
    for name, p in (("cold", prompt(args.prompt_len)), ("warm", long)):
        pr = cProfile.Profile()
        pr.enable()
        run(p)
        pr.disable()
        print(f"== cProfile {name}")
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        run(prompt(args.prompt_len))
    print(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50)
    )
    print(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=50
        )
    )


if __name__ == "__main__":
    main()
