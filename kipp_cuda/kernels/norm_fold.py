"""RMSNorm folded into the one-token GEMVs on either side of it (decode of one sequence, TP = 1).

rms_norm(s) @ W^T with s = h + residual is r * ((s * w) @ W^T), r = rsqrt(mean(s^2) + eps) one
scalar a row. So the GEMV that makes h (o_proj, down_proj: the producer) ends with the residual
add in its epilogue and writes s, xw = s * w (rounded to the model dtype) and each program's fp32
sum of its s^2; the GEMV that reads the norm's output (qkv_proj, gate_up_proj: the consumer)
streams xw as its x and scales its fp32 sums by r, which it makes from those partial sums, before
its epilogue. The norm's launch and one kernel boundary leave the decode step: 71 of an 8B step's
73 norms (the first layer's input norm and the final norm stay kernels).

The rounding differs from rms_norm's at the model dtype's last bit: rms_norm rounds s * r to the
dtype and then times w, the fold rounds s * w and applies r in fp32 (tests hold the difference to
a bf16 bound). `Folded.normed()` is the reference: rms_norm of the same s.

Kernel side: `fold_write` (the producer's epilogue, matmul_tiles._write) and `fold_sums` /
`fold_scale` (the consumer's partial-sum loads, issued before its K loop, and its scale);
`fold_launch` makes a GEMV launch's buffers and arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import triton_runs_on
from kipp_cuda.kernels.rms_norm import rms_norm, rms_norm_ref


@dataclass
class Folded:
    """A norm's output before its scale (module docstring): xw = s * w rounded to s's dtype, the
    new residual s [1, H], fp32 partial sums of s^2 (sq, any count), the norm's weight and eps."""

    xw: torch.Tensor
    residual: torch.Tensor
    sq: torch.Tensor
    weight: torch.Tensor
    eps: float

    @property
    def shape(self) -> torch.Size:
        return self.residual.shape

    def normed(self) -> torch.Tensor:
        """rms_norm's output for s: what a consumer that does not fold reads."""
        return rms_norm(self.residual, self.weight, self.eps)


@dataclass
class Fold:
    """What a producer folds in: the residual [1, N] it adds and the next norm's weight and eps."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


def fold_enabled(x: torch.Tensor) -> bool:
    """Whether the model folds the norm after a GEMV of x: one row, Triton kernels can run on x's
    device, and KIPP_CUDA_NORM_FOLD is not 0 (for A/B runs). A GEMV kernel switched off by the
    user takes its reference, which folds the same way in torch."""
    return (
        x.shape[0] == 1
        and os.environ.get("KIPP_CUDA_NORM_FOLD", "1") != "0"
        and triton_runs_on(x.device.type) is None
    )


def check_fold(fold: Fold | None, norm: Folded | None, N: int, K: int, x: torch.Tensor) -> None:
    if fold is not None:
        if fold.residual.shape != (1, N) or fold.weight.shape != (N,):
            raise ValueError(
                f"fold: residual {tuple(fold.residual.shape)} and weight "
                f"{tuple(fold.weight.shape)} must be [1, {N}] and [{N}]"
            )
        if fold.residual.dtype != x.dtype or not fold.residual.is_contiguous():
            raise ValueError(f"fold: residual must be contiguous {x.dtype}")
    if norm is not None and (norm.xw.shape != (1, K) or norm.sq.dtype != torch.float32):
        raise ValueError(
            f"norm: xw {tuple(norm.xw.shape)} must be [1, {K}] and sq float32, got {norm.sq.dtype}"
        )


def fold_launch(
    fold: Fold | None, norm: Folded | None, n_tiles: int, out: torch.Tensor
) -> tuple[dict, Folded | None]:
    """(the kernel arguments of fold_write and fold_sums, the producer's Folded or None). out is
    the GEMV's [1, N] output, which holds s when folding."""
    kw = dict(res_ptr=out, nw_ptr=out, xw_ptr=out, sq_ptr=out, sqin_ptr=out, num_sq=1, eps=0.0)
    kw.update(RESID=fold is not None, NORM=norm is not None, BLOCK_SQ=1)
    folded = None
    if fold is not None:
        xw = torch.empty_like(out)
        sq = torch.empty(n_tiles, dtype=torch.float32, device=out.device)
        kw.update(res_ptr=fold.residual, nw_ptr=fold.weight, xw_ptr=xw, sq_ptr=sq)
        folded = Folded(xw, out, sq, fold.weight, fold.eps)
    if norm is not None:
        n = norm.sq.numel()
        kw.update(sqin_ptr=norm.sq, num_sq=n, eps=float(norm.eps))
        kw.update(BLOCK_SQ=triton.next_power_of_2(n))
    return kw, folded


@triton.jit
def fold_write(h, rn, N, tile, res_ptr, nw_ptr, s_ptr, xw_ptr, sq_ptr):
    """The producer's epilogue for its fp32 sums h [1, BLOCK_N] of output columns rn: s = h +
    residual rounded as rms_norm's residual add (h rounded to the dtype first, as the GEMV's own
    output), written to s_ptr; xw = s * w rounded; sq_ptr[tile] = sum of s^2 over these columns."""
    dtype = s_ptr.dtype.element_ty
    mask = (rn < N)[None, :]
    r = tl.load(res_ptr + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    s = (h.to(dtype).to(tl.float32) + r).to(dtype)
    tl.store(s_ptr + rn[None, :], s, mask=mask)
    sf = tl.where(mask, s.to(tl.float32), 0.0)
    w = tl.load(nw_ptr + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(xw_ptr + rn[None, :], (sf * w).to(dtype), mask=mask)
    tl.store(sq_ptr + tile, tl.sum(tl.sum(sf * sf, axis=1), axis=0))


@triton.jit
def fold_sums(sqin_ptr, num_sq, BLOCK_SQ: tl.constexpr):
    """The producer's partial sums, loaded early (the consumer sums them after its K loop)."""
    rs = tl.arange(0, BLOCK_SQ)
    return tl.load(sqin_ptr + rs, mask=rs < num_sq, other=0.0)


@triton.jit
def fold_scale(sq, K, eps):
    """r = rsqrt(mean(s^2) + eps) from the partial sums."""
    return tl.math.rsqrt(tl.sum(sq, axis=0) / K + eps)


def fold_ref(out: torch.Tensor, fold: Fold) -> Folded:
    """The producer's outputs from its plain output, in torch (one partial sum)."""
    s = (out.float() + fold.residual.float()).to(out.dtype)
    xw = (s.float() * fold.weight.float()).to(out.dtype)
    return Folded(xw, s, s.float().pow(2).sum().reshape(1), fold.weight, fold.eps)


def norm_ref(norm: Folded) -> torch.Tensor:
    """The consumer's x as the unfolded model reads it: rms_norm_ref of s."""
    return rms_norm_ref(norm.residual, norm.weight, norm.eps)
