"""Where a tensor-parallel decode step's time goes: the batch-1 decode graph of each rank, replayed
back to back (no engine, no host work between steps), with the layers' all-reduce done different
ways. Every variant is captured into its own graph; its logits are checked against NCCL's.

  nccl      dist.all_reduce on the activation (what the model does)
  none      no all-reduce at all: the compute floor of a rank (logits are wrong, by design)
  symm      torch symmetric memory's one-shot all-reduce (copy in, reduce out of the peers)
  ncclwin   dist.all_reduce on a buffer registered as an NCCL symmetric window (NCCL >= 2.27
            then runs its symmetric low-latency kernels)

NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python scripts/tp_step_profile.py \
    --shape qwen3-8b --variants nccl,none,symm,ncclwin [--profile]
"""

from __future__ import annotations

import argparse
import ctypes
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kipp_core.backend import BackendOptions
from kipp_core.checkpoint import Checkpoint
from kipp_core.tiny import random_checkpoint
from kipp_cuda.runner import CTX, POS
from kipp_cuda.tp_backend import SAFE_ENV, _free_port, _init


def _libnccl() -> ctypes.CDLL:
    """The NCCL library this process already loaded (torch's), by its path in /proc/self/maps."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libnccl" in line}
    if not paths:
        raise RuntimeError("no libnccl loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


def _pair(make, n):
    """Two buffers used in turn: a peer still reading buffer i of call k is done with it before
    this rank can start call k + 2 (each call begins with a barrier)."""
    bufs, turn = [make(n) for _ in range(2)], [0]

    def take(numel):
        b = bufs[turn[0]][:numel]
        turn[0] ^= 1
        return b
    return take


def _reducers(device, dtype, hidden, world):
    """name -> (a function x -> all-reduced x, or None for plain NCCL), where available."""
    group = dist.group.WORLD
    out, notes = {"nccl": None, "none": lambda x: x}, []
    try:
        import torch.distributed._symmetric_memory as symm_mem

        def make_symm(n):
            b = symm_mem.empty(n, device=device, dtype=dtype)
            symm_mem.rendezvous(b, group.group_name)
            return b
        take = _pair(make_symm, hidden)
        ops = torch.ops.symm_mem

        def symm(x):
            b = take(x.numel())
            b.copy_(x.view(-1))
            return ops.one_shot_all_reduce(b, "sum", group.group_name).view_as(x)
        out["symm"] = symm
    except Exception as e:  # not in this torch build
        notes.append(f"symm unavailable: {type(e).__name__}: {str(e)[:120]}")
    try:
        backend = group._get_backend(device)
        lib = _libnccl()
        pool = torch.cuda.MemPool(backend.mem_allocator)
        comm = ctypes.c_void_p(backend._comm_ptr())
        keep = []

        def make_win(n):
            with torch.cuda.use_mem_pool(pool):
                b = torch.zeros(n, dtype=dtype, device=device)
            torch.cuda.synchronize(device)
            win = ctypes.c_void_p()
            rc = lib.ncclCommWindowRegister(comm, ctypes.c_void_p(b.data_ptr()),
                                            ctypes.c_size_t(b.numel() * b.element_size()),
                                            ctypes.byref(win), ctypes.c_int(1))  # SYMMETRIC
            if rc != 0 or not win.value:
                raise RuntimeError(f"ncclCommWindowRegister returned {rc}")
            keep.append((pool, win))
            return b
        take_w = _pair(make_win, hidden)

        def ncclwin(x):
            b = take_w(x.numel())
            b.copy_(x.view(-1))
            dist.all_reduce(b)
            return b.view_as(x)
        out["ncclwin"] = ncclwin
    except Exception as e:
        notes.append(f"ncclwin unavailable: {type(e).__name__}: {str(e)[:160]}")
    return out, notes


def _rank(rank, world, port, path, args, results):
    from kipp_cuda.backend import ShardBackend

    device = _init(rank, world, port, "cuda")
    opts = BackendOptions(kv_cache_memory="4GiB", max_num_seqs=1, max_model_len=4096,
                          tensor_parallel=world)
    shard = ShardBackend(Checkpoint(path), opts, device, rank, world)
    runner, model = shard.runner, shard.model
    runner.g_in[CTX, 0], runner.g_in[POS, 0] = args.context, args.context - 1
    reducers, notes = _reducers(device, model.dtype, model.config.hidden_size, world)
    rows, ref = [], None
    for name in args.variants.split(","):
        if name not in reducers:
            rows.append((name, float("nan"), "not available"))
            continue
        for layer in model.layers:
            layer.__dict__.pop("_reduce", None)
            if reducers[name] is not None:
                layer._reduce = reducers[name]
        fn = runner._graph_fn("decode", 1)
        fn()
        dist.barrier()
        g, logits = runner._capture(fn, None)
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
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25,
                                      max_name_column_width=70)
    with open(path, "w") as f:
        f.write(table)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--variants", default="nccl,none,symm,ncclwin")
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
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, path, args, results))
             for port in [_free_port()] for r in range(args.world)]
    for proc in procs:
        proc.start()
    gathered = results.get(timeout=900)
    for proc in procs:
        proc.join(timeout=60)
    print(f"{args.shape} TP={args.world}, batch-1 decode graph, context {args.context}, "
          f"{args.steps} replays back to back")
    print("| variant | " + " | ".join(f"rank {r} ms/step" for r in range(args.world))
          + " | tok/s | check |")
    print("|---|" + "---|" * args.world + "---|---|")
    for i, (name, _, note) in enumerate(gathered[0][0]):
        ms = [g[0][i][1] for g in gathered]
        print(f"| {name} | " + " | ".join(f"{m:.3f}" for m in ms)
              + f" | {1000 / max(ms):.1f} | {note} |")
    for r, (_, notes) in enumerate(gathered):
        for n in notes:
            print(f"rank {r}: {n}")


if __name__ == "__main__":
    main()
