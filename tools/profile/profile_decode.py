"""Where a decode step's time goes on the CUDA backend: engine, input preparation, graph replay,
logits, sampling; plus a per-kernel table of one eager decode step (torch.profiler).

python tools/profile/profile_decode.py --shape qwen3-0.6b --batch 1 --context 2048

--timeline: instead of the eager per-kernel table, profile the engine's own steps (graphs on) and
print where the GPU idles between its activities: the gaps summed by what ends before and starts
after them, and the copies a step queues outside the graph.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
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
    p.add_argument("--timeline", action="store_true", help="GPU gaps of graph-on engine steps")
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
    if args.timeline:  # before the timing wrappers below, which synchronize
        print(
            f"{args.shape} batch {args.batch}: {plain * 1e3:.3f} ms an engine step, "
            f"{replay_ms(runner, args.batch):.3f} ms a decode graph replayed back to back"
        )
        return timeline(eng, args.steps)
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
    print(f"  graph replay alone (GPU)                 {replay_ms(runner, args.batch):8.3f} ms")
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


def replay_ms(runner, batch: int) -> float:
    g = runner.graphs["decode", next(b for b in runner.graph_bs if b >= batch)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50


def timeline(eng, steps: int) -> None:
    """The GPU's activities over `steps` engine steps (graphs on): busy time, and the idle gaps
    between consecutive activities summed by (the one before, the one after)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    gpu = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["cat"], e["name"][:60])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    busy, gaps, end, prev = 0.0, collections.Counter(), gpu[0][0], "start"
    counts = collections.Counter(f"{c}: {n}" for _, _, c, n in gpu if c != "kernel")
    for t0, t1, _, name in gpu:
        if t0 > end:
            gaps[f"{prev} -> {name}"] += t0 - end
        busy += max(0.0, t1 - max(t0, end))
        if t1 > end:
            end, prev = t1, name
    window = end - gpu[0][0]
    print(
        f"{steps} engine steps: {window / steps:.1f} us a step, GPU busy {busy / steps:.1f}, "
        f"idle {(window - busy) / steps:.1f} ({len(gpu) / steps:.0f} activities a step)"
    )
    print("idle us a step, by (activity before -> after):")
    for k, v in gaps.most_common(12):
        print(f"  {v / steps:8.2f}  {k}")
    print("copies and sets a step:")
    for k, v in counts.most_common(8):
        print(f"  {v / steps:6.2f}  {k}")


if __name__ == "__main__":
    main()
