"""Where a decode step's time goes on the CUDA backend: engine, input preparation, graph replay,
logits, sampling; plus a per-kernel table of one eager decode step (torch.profiler).

python scripts/profile_decode.py --shape qwen3-0.6b --batch 1 --context 2048
"""

from __future__ import annotations

import argparse
import time

import torch

from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from kipp_core.tiny import random_checkpoint


def timed(fn, sections, name):
    def run(*a, **k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        sections[name] = sections.get(name, 0.0) + time.perf_counter() - t
        return out

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--quant", default=None)
    p.add_argument("--kv-cache-memory", default="48GiB")
    args = p.parse_args()
    path = random_checkpoint(args.shape)
    # Room for every sequence's context: a smaller budget preempts, and the batch shrinks.
    llm = LLM(
        str(path),
        backend="cuda",
        quant=args.quant,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=max(8, args.batch),
    )
    eng, runner = llm.engine, llm.backend.runner
    sp = SamplingParams(temperature=0, max_tokens=10 * args.steps, ignore_eos=True)
    # A different prompt a sequence: shared prefix-cache blocks would be read from L2 and flatter
    # the attention kernel at large batch (the batch-256 profile of 2026-11-30c had that).
    prompts = [
        [1000 + (j * 7 + i * 13) % 100000 for j in range(args.context)] for i in range(args.batch)
    ]
    for i in range(args.batch):
        eng.add_request(f"r{i}", prompts[i], sp)
    while any(len(st.seq.output_token_ids) < 2 for r in eng.requests.values() for st in r.states):
        eng.step()
    t = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    torch.cuda.synchronize()
    plain = (time.perf_counter() - t) / args.steps
    sections: dict[str, float] = {}
    runner.forward = timed(runner.forward, sections, "forward (prepare + graph replay, logits)")
    runner._replay = timed(runner._replay, sections, "  graph replay incl. input copies")
    import kipp_cuda.runner as rmod

    rmod.sample_tokens = timed(rmod.sample_tokens, sections, "sample_tokens")
    runner.execute_async = timed(runner.execute_async, sections, "runner.execute_async")
    t = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    total = (time.perf_counter() - t) / args.steps
    running = len(eng.scheduler.running)
    if running != args.batch:
        print(
            f"only {running} of {args.batch} sequences run (KV budget): the numbers below are "
            f"not for batch {args.batch}"
        )
    print(
        f"{args.shape} batch {args.batch} context {args.context}: {plain * 1e3:.3f} ms/step "
        f"({args.batch / plain:.0f} tok/s); with syncs {total * 1e3:.3f} ms/step"
    )
    for k, v in sections.items():
        print(f"  {k:<40} {v / args.steps * 1e3:8.3f} ms")
    g = runner.graphs["decode", next(b for b in runner.graph_bs if b >= args.batch)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"  graph replay alone (GPU)                 {start.elapsed_time(end) / 50:8.3f} ms")
    # One eager decode step through the profiler: per-kernel GPU time.
    runner.graphs.clear()
    runner.graph_bs, runner.prefill_tokens = [], []
    eng.step()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=60
        )
    )


if __name__ == "__main__":
    main()
