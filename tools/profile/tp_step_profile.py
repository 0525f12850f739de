"""Where a tensor-parallel decode step's time goes: the batch-1 decode graph of each rank, replayed
back to back (no engine, no host work between steps), with the layers' all-reduce done different
ways (TPReduce.mode). Every variant is captured into its own graph; its logits are checked
against the first variant's.

  peer      the fused push/flag all-reduce + residual + RMSNorm kernel (what the model does at
            TP = 2 on GPUs; kernels/allreduce_rms_norm.py)
  nccl      dist.all_reduce on the activation, then rms_norm
  none      no all-reduce at all: the compute floor of a rank (logits are wrong, by design)

(Torch symmetric memory's one-shot all-reduce and NCCL symmetric windows beat NCCL by at most
0.11 ms a step: benchmarks/LOG.md, entry 230e152.)

NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python tools/profile/tp_step_profile.py \
    --shape qwen3-8b --variants peer,nccl,none [--profile]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kipp_core.backend import BackendOptions
from kipp_core.checkpoint import Checkpoint
from kipp_core.tiny import random_checkpoint
from kipp_cuda.tp_backend import SAFE_ENV, _free_port, _init


def _rank(rank, world, port, path, args, results):
    from kipp_cuda.backend import ShardBackend

    device = _init(rank, world, port, "cuda")
    opts = BackendOptions(
        kv_cache_memory="4GiB", max_num_seqs=1, max_model_len=4096, tensor_parallel=world
    )
    shard = ShardBackend(Checkpoint(path), opts, device, rank, world)
    runner, model = shard.runner, shard.model
    runner.inputs.stage_one_sequence(args.context, runner.block_size)
    rows, ref, notes = [], None, [f"model's own mode: {model.tp.mode}"]
    for name in args.variants.split(","):
        if name == "peer" and not hasattr(model.tp, "recv"):
            rows.append((name, float("nan"), "not available"))
            continue
        model.tp.mode = name
        fn = runner._graph_fn("decode", 1)
        fn()
        dist.barrier()
        g, (_, logits, _) = runner._capture(fn, None)  # (hidden, logits, argmax)
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize(device)
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.steps):
            g.replay()
        b.record()
        torch.cuda.synchronize(device)
        ms = a.elapsed_time(b) / args.steps
        got = logits.float().clone()
        if ref is None:
            ref = got
        err = float((got - ref).abs().max() / ref.abs().max())
        if args.profile:
            _profile(g, device, f"{args.out}/tp_profile_{name}_rank{rank}.txt")
        rows.append((name, ms, f"logits max rel diff vs first {err:.1e}"))
        del g
        torch.cuda.synchronize(device)
        dist.barrier()
    gathered = [None] * world
    dist.all_gather_object(gathered, (rows, notes))
    if rank == 0:
        results.put(gathered)
    dist.barrier()
    runner.graphs.clear()
    dist.destroy_process_group()


def _profile(g, device, path):
    """Per-kernel GPU time of three replays (CUPTI sees a graph's kernels one by one)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize(device)
    table = prof.key_averages().table(
        sort_by="self_device_time_total", row_limit=25, max_name_column_width=70
    )
    with open(path, "w") as f:
        f.write(table)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--variants", default="peer,nccl,none")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = p.parse_args()
    os.environ.update(SAFE_ENV)
    path = random_checkpoint(args.shape)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world, port, path, args, results))
        for port in [_free_port()]
        for r in range(args.world)
    ]
    for proc in procs:
        proc.start()
    gathered = results.get(timeout=900)
    for proc in procs:
        proc.join(timeout=60)
    print(
        f"{args.shape} TP={args.world}, batch-1 decode graph, context {args.context}, "
        f"{args.steps} replays back to back"
    )
    print(
        "| variant | "
        + " | ".join(f"rank {r} ms/step" for r in range(args.world))
        + " | tok/s | check |"
    )
    print("|---|" + "---|" * args.world + "---|---|")
    for i, (name, _, note) in enumerate(gathered[0][0]):
        ms = [g[0][i][1] for g in gathered]
        print(
            f"| {name} | "
            + " | ".join(f"{m:.3f}" for m in ms)
            + f" | {1000 / max(ms):.1f} | {note} |"
        )
    for r, (_, notes) in enumerate(gathered):
        for n in notes:
            print(f"rank {r}: {n}")


if __name__ == "__main__":
    main()
