"""Latency of the decode step's all-reduces on two GPUs, inside a CUDA graph as a decode step
runs them: NCCL (with whatever NCCL_* settings the environment holds) and, where this torch has
it, torch.distributed's symmetric-memory one-shot all-reduce.

NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python tools/profile/allreduce_bench.py
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = (4096, 5120, 4096 * 16)  # 8B and 32B hidden at batch 1; 8B at batch 16
CALLS = 72  # two a layer, 36 layers


def _time_graph(fn, reps=20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / reps / CALLS


def _run(rank: int, world: int, port: int, label: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank)
    )
    rows = []
    for n in SIZES:
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16)

        def nccl(x=x):
            for _ in range(CALLS):
                dist.all_reduce(x)

        rows.append((f"nccl {label}", n, _time_graph(nccl)))
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD
            buf = symm_mem.empty(n, device="cuda", dtype=torch.bfloat16)
            symm_mem.rendezvous(buf, group.group_name)
            buf.copy_(x)

            def one_shot(buf=buf, group=group):
                for _ in range(CALLS):
                    torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)

            rows.append(("symm_mem one_shot", n, _time_graph(one_shot)))
            y = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group.group_name)
            ref = buf.clone()
            dist.all_reduce(ref)
            rows.append(("symm_mem equals nccl", n, float((y - ref).abs().max())))
        except Exception as e:  # not in this torch, or not on this machine
            rows.append((f"symm_mem unavailable: {type(e).__name__}: {str(e)[:80]}", n, 0.0))
    if rank == 0:
        for name, n, us in rows:
            print(f"{name:<48} {n * 2 / 1024:6.0f} KiB  {us:8.2f} us")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    label = (
        " ".join(
            f"{k}={v}"
            for k, v in os.environ.items()
            if k.startswith("NCCL_") and k != "NCCL_NVLS_ENABLE"
        )
        or "default"
    )
    mp.spawn(_run, args=(2, 29600 + os.getpid() % 1000, label), nprocs=2, join=True)
    sys.exit(0)
