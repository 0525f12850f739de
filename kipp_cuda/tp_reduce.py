"""The all-reduce of a layer's row-parallel output together with the residual add and RMSNorm that
follow it: `reduce_norm(x, residual, weight)` at every call site of a forward (each layer's input
norm and post-attention norm, and the final norm).

- TP = 1: rms_norm alone.
- TP = 2 on GPUs, up to MAX_T rows (decode of a few sequences): one fused kernel
  (kernels/allreduce_rms_norm.py) that pushes this rank's rows into the peer's receive buffer
  over NVLink, trades a flag, and normalizes the sum; the receive buffers and flags are torch
  symmetric memory, one slot a call site, so a CUDA graph bakes fixed addresses. NCCL's
  all-reduce of 8 KB costs ~9.6 us a call in the 8B decode graph, this kernel with the norm ~2.7
  (benchmarks/LOG.md, entries 230e152 and 752bd46).
- Otherwise (more rows, CPU/gloo, TP > 2, KIPP_CUDA_PEER_ALLREDUCE=0): torch.distributed's
  all-reduce, then rms_norm. On a GPU at TP > 2, or where symmetric memory cannot be set up, that
  is a reported fallback (fatal under KIPP_CUDA_REQUIRE_KERNELS=1).
Both ranks must make the same calls in the same order (the scheduler broadcasts every batch), so
the per-row epochs on both sides advance together.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from kipp_core.fastpath import report_fallback
from kipp_cuda.kernels.allreduce_rms_norm import allreduce_rms_norm
from kipp_cuda.kernels.rms_norm import rms_norm

MAX_T = 8  # rows a fused call takes; larger batches and prefill chunks go through NCCL


class TPReduce:
    def __init__(
        self,
        rank: int,
        world: int,
        sites: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.rank, self.world, self.sites = rank, world, sites
        self.site = 0  # the next call site of this forward
        self.mode = "nccl" if world > 1 else "local"  # "peer": the fused kernel; "none": floors
        if world == 1 or device.type != "cuda" or os.environ.get("KIPP_CUDA_PEER_ALLREDUCE") == "0":
            return
        if world != 2:
            report_fallback(
                "cuda",
                "allreduce_rms_norm",
                f"the fused peer all-reduce runs at TP = 2, not {world}: NCCL, then rms_norm",
            )
            return
        try:
            self._setup(hidden, dtype, device)
            self.mode = "peer"
        except Exception as e:  # noqa: BLE001 - any failure of symmetric memory: NCCL instead
            report_fallback(
                "cuda",
                "allreduce_rms_norm",
                f"no symmetric memory ({type(e).__name__}: {str(e)[:160]})",
            )

    def _setup(self, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD.group_name
        rows = self.sites * MAX_T
        data = symm_mem.empty(rows * hidden, device=device, dtype=dtype)
        flags = symm_mem.empty(rows, device=device, dtype=torch.int32)
        flags.zero_()
        peer = 1 - self.rank
        data_h = symm_mem.rendezvous(data, group)
        flags_h = symm_mem.rendezvous(flags, group)
        self.recv = data.view(self.sites, MAX_T, hidden)
        self.send = data_h.get_buffer(peer, (rows * hidden,), dtype).view(self.sites, MAX_T, hidden)
        self.recv_flags = flags.view(self.sites, MAX_T)
        self.send_flags = flags_h.get_buffer(peer, (rows,), torch.int32).view(self.sites, MAX_T)
        self.epochs = torch.zeros((self.sites, MAX_T), dtype=torch.int32, device=device)
        self._keep = (data, flags, data_h, flags_h)
        torch.cuda.synchronize(device)
        dist.barrier()  # both ranks' flags are zero before either signals

    def begin(self) -> None:
        """A forward starts: call sites count from 0 again."""
        self.site = 0

    def reduce_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum over ranks of x [+ residual]) * weight, the new residual) for x [T, H],
        this rank's partial rows (at TP = 1, x itself)."""
        site = self.site
        self.site += 1
        if self.mode == "peer" and x.shape[0] <= MAX_T:
            if site >= self.sites:
                raise RuntimeError(f"TPReduce: call site {site} of a forward; {self.sites} set up")
            return allreduce_rms_norm(
                x,
                weight,
                eps,
                residual,
                self.send[site],
                self.send_flags[site],
                self.recv[site],
                self.recv_flags[site],
                self.epochs[site],
            )
        if self.mode in ("nccl", "peer"):
            dist.all_reduce(x)
        if residual is None:
            return rms_norm(x, weight, eps), x
        return rms_norm(x, weight, eps, residual)
