"""Where a prefix-cache hit's TTFT goes on the CUDA backend: the engine's and the runner's phases
(host time, median of --runs), then a torch.profiler table of the same requests. Two kinds of hit:
the same prompt again (a prompt-end hit: no layer runs) and a new last token (the tokens after the
last full block run through a prefill graph over the cached context).

python tools/profile/profile_prefix_hit.py --shape qwen3-0.6b --prompt-len 6890 --out /tmp/out
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import numpy as np
import torch

from kipp_core.llm import LLM
from kipp_core.sampling_params import SamplingParams
from kipp_core.tiny import random_checkpoint
from kipp_cuda import runner as runner_mod


def _timed(obj, name: str, acc: dict, key: str) -> None:
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        acc[key].append(time.perf_counter() - t0)
        return out

    setattr(obj, name, wrapper)


def _requests(llm, prompts, params) -> list[float]:
    return [llm.generate([p], params, use_tqdm=False)[0].metrics.ttft for p in prompts]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--prompt-len", type=int, default=6890)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    llm = LLM(str(random_checkpoint(args.shape)), backend="cuda", kv_cache_memory="16GiB")
    eng, runner = llm.engine, llm.backend.runner
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 150000, args.prompt_len).tolist()
    edited = [prompt[:-1] + [int(t)] for t in rng.integers(0, 150000, 2 * args.runs + 4)]
    _requests(llm, [prompt, prompt, edited[0], edited[1]], params)  # compile, fill the cache
    acc = collections.defaultdict(list)
    for obj, name, key in (
        (eng, "add_request", "engine.add_request"),
        (eng.scheduler, "schedule", "scheduler.schedule"),
        (eng, "_seq_input", "engine._seq_input"),
        (eng.backend, "execute_async", "backend.execute_async (host)"),
        (eng, "_postprocess", "engine._postprocess"),
        (eng, "_collect_outputs", "engine._collect_outputs"),
        (eng.block_manager, "allocate_prefix", "block_manager.allocate_prefix"),
        (runner.model, "compute_logits", "model.compute_logits (host)"),
        (runner_mod, "sample_tokens", "sample_tokens (host)"),
        (runner_mod.PendingSamples, "result", "PendingSamples.result (wait)"),
    ):
        _timed(obj, name, acc, key)
    lines = []
    for label, prompts in (("same prompt", [prompt] * args.runs), ("new last token", edited[2:])):
        acc.clear()
        ttft = _requests(llm, prompts[: args.runs], params)
        lines.append(f"## {label}: TTFT median {statistics.median(ttft) * 1e3:.3f} ms")
        for k, v in acc.items():
            lines.append(
                f"  {k:40s} {statistics.median(v) * 1e6:9.1f} us x {len(v) / args.runs:.0f}"
            )
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    for label, prompts in (("same prompt", [prompt] * 5), ("new last token", edited[-5:])):
        with torch.profiler.profile(activities=acts) as prof:
            _requests(llm, prompts, params)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        cuda = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
        lines += [f"## profile, {label}, 5 requests (by host time)", table, "(by GPU time)", cuda]
    text = "\n".join(lines)
    print(text)
    with open(f"{args.out}/profile_prefix_hit.txt", "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
