"""Where a batch-1 engine decode step's time goes beyond its graph, step by step, without a
profiler: kipp bench's decode loop (measure_decode) with a CUDA event after every decode graph
replay and the host's time in each engine.step(). Prints the GPU's replay-to-replay intervals
(median, mean, the slowest and where in the run they fell) against the host's step times, so that
a mean above the median shows as a few slow steps, and a slow median as a slow steady state.

python tools/profile/decode_gaps.py --shape qwen3-8b --quant affine4 --kv-cache-memory 16GiB
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from kipp_core.tiny import random_checkpoint


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quant", default=None)
    p.add_argument("--kv-cache-memory", default="16GiB")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    llm = LLM(
        str(random_checkpoint(args.shape)),
        backend="cuda",
        quant=args.quant,
        kv_cache_memory=args.kv_cache_memory,
    )
    eng, runner = llm.engine, llm.backend.runner
    events: list[torch.cuda.Event] = []
    replay_graph = runner._replay_graph

    def spy(key, *a):
        out = replay_graph(key, *a)
        if key[0] == "decode":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            events.append(ev)
        return out

    runner._replay_graph = spy
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0, max_tokens=args.gen_len, ignore_eos=True)
    for run in range(args.runs):
        events.clear()
        prompt = rng.integers(100, 100_000, args.prompt_len).tolist()
        eng.add_request(f"r{run}", prompt, sp)
        host, t_first, t_end = [], None, None
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            outs = eng.step()
            host.append(time.perf_counter() - t)
            if t_first is None and outs and outs[0].outputs[0].token_ids:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        torch.cuda.synchronize()
        gpu = [a.elapsed_time(b) * 1e3 for a, b in zip(events, events[1:])]  # us
        n = len(events) - 1
        slow = sorted(range(len(gpu)), key=lambda i: -gpu[i])[:6]
        window = 1e6 * (t_end - t_first) / n
        print(
            f"run {run}: {len(events)} decode replays; host window {window:.1f} us a step; "
            f"GPU replay-to-replay median {statistics.median(gpu):.1f}, mean "
            f"{statistics.fmean(gpu):.1f}, sum {sum(gpu) / 1e3:.2f} ms"
        )
        print("  slowest (step: us): " + ", ".join(f"{i}: {gpu[i]:.1f}" for i in slow))
        h = [1e6 * x for x in host]
        print(
            f"  host engine.step(): median {statistics.median(h):.1f} us, max {max(h):.1f} "
            f"(at {h.index(max(h))} of {len(h)})"
        )


if __name__ == "__main__":
    main()
