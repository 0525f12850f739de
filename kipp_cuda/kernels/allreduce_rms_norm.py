"""All-reduce of two ranks' partial rows fused with the residual add and RMSNorm that follow it
(tensor parallelism at TP = 2, a few tokens a step): one launch instead of an NCCL all-reduce and
an rms_norm launch.

Each rank holds, in symmetric memory (kipp_cuda/tp_reduce.py), a receive row and an int32 flag
per (call site, token). A program owns one token row:
  1. push: store this rank's partial row into the peer's receive row (NVLink stores);
  2. signal: a barrier, then one release store (system scope) of the row's epoch (a per-row
     counter, +1 a call, kept in this rank's memory) into the peer's flag;
  3. wait: spin on this rank's own flag until the peer's epoch arrives (acquire), or trap after
     TIMEOUT_S (NCCL's watchdog waits 10 minutes too: a rank compiling kernels at start-up can be
     that far behind); a peer that never comes becomes a CUDA error, which takes the worker down,
     instead of a hang;
  4. s = partial + peer's partial rounded to the model dtype (what NCCL's sum of two bf16 rows
     gives; the add commutes, so both ranks get the same bits), then exactly rms_norm's residual
     add and normalization (the same row layout, so the same reduction order).
A row's receive buffer is written again only at the same call site of a later step, after the
peer has passed every other site's wait, so one buffer a site is enough.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels.pdl import launch_kwargs
from kipp_cuda.kernels.rms_norm import (
    check_norm_args,
    load_row,
    norm_row,
    rms_norm_ref,
    row_launch,
)

TIMEOUT_S = 600  # how long a program waits for the peer's row before it traps
MAX_SPINS = 1 << 16  # flag polls before giving up under the interpreter (no clock there)


@triton.jit
def _trap(x):
    tl.inline_asm_elementwise("trap;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _now_ns(x):
    # %globaltimer, ns; x only carries the asm (it is elementwise)
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def _allreduce_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    send_ptr,
    send_flag_ptr,
    recv_ptr,
    recv_flag_ptr,
    epoch_ptr,
    H,
    eps,
    max_spins,
    timeout_ns,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,
):
    # send/recv rows: [T, H] of this call site in the peer's / this rank's receive buffer;
    # send/recv flags and epochs: [T] int32.
    t, cols, mask, w, x = load_row(x_ptr, w_ptr, stride_x, H, BLOCK_H, PDL)
    dtype = x.dtype
    tl.store(send_ptr + t * H + cols, x, mask=mask)
    e = tl.load(epoch_ptr + t) + 1
    tl.debug_barrier()  # every thread's stores are issued before the one release below
    tl.store(epoch_ptr + t, e)
    tl.atomic_xchg(send_flag_ptr + t, e, sem="release", scope="sys")
    seen = tl.atomic_add(recv_flag_ptr + t, 0, sem="acquire", scope="sys")
    if ASM:  # bounded by the clock
        deadline = _now_ns(seen) + timeout_ns
        while (seen < e) & (_now_ns(seen) < deadline):
            seen = tl.atomic_add(recv_flag_ptr + t, 0, sem="acquire", scope="sys")
        if seen < e:
            _trap(seen)
    else:  # bounded by a poll count
        spins = 0
        while (seen < e) & (spins < max_spins):
            seen = tl.atomic_add(recv_flag_ptr + t, 0, sem="acquire", scope="sys")
            spins += 1
    tl.debug_barrier()  # the acquire above is every thread's
    # .cg: the row was written over NVLink; a line of it in this SM's L1 would be stale
    y = tl.load(recv_ptr + t * H + cols, mask=mask, other=0.0, cache_modifier=".cg")
    s = (x.to(tl.float32) + y.to(tl.float32)).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (s + r).to(dtype).to(tl.float32)
    tl.store(res_out_ptr + t * stride_ro + cols, s.to(dtype), mask=mask)
    tl.store(out_ptr + t * stride_o + cols, norm_row(s, w, H, eps, dtype), mask=mask)


def allreduce_rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    send: torch.Tensor,
    send_flags: torch.Tensor,
    recv: torch.Tensor,
    recv_flags: torch.Tensor,
    epochs: torch.Tensor,
    asm: bool | None = None,
    timeout_s: float = TIMEOUT_S,
):
    """(rms_norm(x + peer's x [+ residual]) * weight, the sum that became the new residual) for
    x [T, H], this rank's partial rows. send/recv: [>= T, H] rows of this call site in the
    peer's and in this rank's receive buffer; send_flags/recv_flags/epochs: [>= T] int32 (see the
    module docstring)."""
    check_norm_args(x, weight, residual)
    T, H = x.shape
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("allreduce_rms_norm needs the hidden dimension contiguous")
    if send.shape[0] < T or recv.shape[0] < T or send.shape[1:] != (H,) or send.dtype != x.dtype:
        raise ValueError(
            f"receive rows {tuple(send.shape)} {send.dtype} cannot hold x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    if T == 0:
        return out, res_out
    block_h, num_warps = row_launch(H)
    pdl = launch_kwargs(x.device)
    _allreduce_rms_norm_kernel[(T,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out,
        send,
        send_flags,
        recv,
        recv_flags,
        epochs,
        H,
        float(eps),
        MAX_SPINS,
        int(timeout_s * 1e9),
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        res_out.stride(0),
        BLOCK_H=block_h,
        HAS_RESIDUAL=residual is not None,
        PDL=bool(pdl),
        ASM=x.is_cuda if asm is None else asm,
        num_warps=num_warps,
        **pdl,
    )
    return out, res_out


def allreduce_rms_norm_ref(
    x: torch.Tensor,
    peer_x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
):
    """What the fused kernel computes, given the peer's partial rows: the model-dtype sum, then
    rms_norm with the residual (or the sum itself as the new residual)."""
    s = (x.float() + peer_x.float()).to(x.dtype)
    if residual is None:
        return rms_norm_ref(s, weight, eps), s
    return rms_norm_ref(s, weight, eps, residual)
