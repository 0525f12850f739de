"""Where the offline-throughput benchmark's time goes: the workload of `kipp bench --num-requests`
(random prompt and output lengths), each engine step logged with its batch, and the wall time
between consecutive step completions (under async scheduling that is the GPU's time a step).
Prints time by step kind and decode batch size, and the KV bytes decode attention must read, so
that the attention floor at the H200's bandwidth can be set against the measured time.

python tools/profile/profile_throughput.py --shape qwen3-0.6b --num-requests 256
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kipp_core.bench import _greedy, random_prompts
from kipp_core.llm import LLM
from kipp_core.tiny import random_checkpoint

HBM_TB_S = 4.3  # the H200's copy bandwidth (kipp bench --kernels: 4.25 TB/s, read + write)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory", default="48GiB")
    p.add_argument(
        "--torch-profile",
        type=int,
        default=0,
        help="also profile the first N steps (the prefill-heavy ones) per kernel",
    )
    args = p.parse_args()
    llm = LLM(
        str(random_checkpoint(args.shape)), backend="cuda", kv_cache_memory=args.kv_cache_memory
    )
    cfg = llm.engine.config.scheduler
    mc = llm.backend.runner.model.config
    kv_bytes_per_token = (
        mc.num_hidden_layers
        * mc.num_key_value_heads
        * mc.head_dim
        * 2
        * llm.backend.runner.kv_caches[0].k.element_size()
    )
    rng = np.random.default_rng(0)
    lens = rng.integers(args.min_len, args.max_len + 1, size=(args.num_requests, 2))
    prompts = [random_prompts(1, int(n), rng)[0] for n, _ in lens]
    params = [_greedy(int(g)) for _, g in lens]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up

    steps: list[tuple[int, int, int, float]] = []  # (seqs, tokens, context tokens, done at)
    record = llm.engine.stats.record_step

    def logged(batch, seconds):
        ctx = sum(s.start_pos + len(s.token_ids) for s in batch.seqs)
        steps.append((len(batch.seqs), batch.num_tokens, ctx, time.perf_counter()))
        record(batch, seconds)

    llm.engine.stats.record_step = logged
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t0
    out_tokens = sum(len(o.token_ids) for o in outs)
    print(
        f"{args.shape}, {args.num_requests} requests: {total:.2f} s, "
        f"{out_tokens / total:.0f} output tok/s, {len(steps)} steps (config {cfg})"
    )
    prev = t0
    kinds: dict[str, list[float]] = {}
    kv_read = 0
    for seqs, tokens, ctx, done in steps:
        dt, prev = done - prev, done
        if tokens > seqs:
            key = "with prefill"
        else:
            key = f"decode b{(seqs - 1) // 64 * 64 + 1:3}-{(seqs - 1) // 64 * 64 + 64:3}"
            kv_read += ctx * kv_bytes_per_token
        k = kinds.setdefault(key, [0, 0.0, 0, 0])
        k[0] += 1
        k[1] += dt
        k[2] += seqs
        k[3] += ctx
    for key, (n, sec, seqs, ctx) in sorted(kinds.items()):
        print(
            f"  {key:18} {n:5} steps {sec:7.3f} s  {sec / n * 1e3:7.2f} ms/step  "
            f"mean batch {seqs / n:6.1f}  mean context {ctx / max(seqs, 1):6.0f}"
        )
    print(
        f"decode attention reads {kv_read / 1e12:.2f} TB of KV: "
        f"{kv_read / (HBM_TB_S * 1e12):.2f} s at {HBM_TB_S} TB/s"
    )
    if args.torch_profile:
        import torch

        eng = llm.engine
        for i, (pr, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"p{i}", pr, sp)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
        ) as prof:
            t = time.perf_counter()
            for _ in range(args.torch_profile):
                eng.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        print(
            f"first {args.torch_profile} steps again, profiled: "
            f"{(time.perf_counter() - t) * 1e3:.0f} ms"
        )
        print(
            prof.key_averages().table(
                sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=50
            )
        )
        for i in range(len(prompts)):
            eng.abort_request(f"p{i}")


if __name__ == "__main__":
    main()
