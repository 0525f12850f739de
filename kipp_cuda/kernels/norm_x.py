"""The residual add + RMSNorm in front of a one-token GEMV, done inside the GEMV's reads of x.

At decode of one sequence the layer's two norms (before qkv_proj and gate_up_proj) were launches
of their own. With NORM, a GEMV takes the norm's inputs instead of x: hidden [1, K], an optional
residual [1, K], the norm weight [K] and eps. Every program first (after pdl_wait: hidden and
residual come from the previous kernel) sums s^2 over the whole row, s = hidden + residual
rounded to the model dtype, for rstd = rsqrt(mean(s^2) + eps); program (0, 0) also stores s, the
new residual, into res_out (another buffer than residual, which the other programs still read).
Wherever the GEMV read x[k] it then uses what rms_norm.py would have written:
((s[k] rstd) rounded, times w[k]) rounded. Only the order of the s^2 sum differs from rms_norm's,
so the two agree within rounding, not bit for bit.

Off by default (KIPP_CUDA_FUSED_NORM=1, kipp_cuda/layers.py): it costs more than the launch it
saves. Every program reads the whole row for rstd, and every thread norms the x of its groups
again for each program (offline SASS, scripts/gemv_sass.py --norm both: 1.45 -> 2.88
instructions a weight for q8_0's int16-x loop). On an H200 in CUDA graphs the rms_norm launch
cost 1.1-1.7 us, but the fused 8B gate_up GEMV was 5-29 us slower than rms_norm + the GEMV, and
an 8B decode step went 2.87 -> 3.99 ms (q8_0), 2.08 -> 2.41 ms (affine4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels.bits import aligned_x, load_x8
from kipp_cuda.kernels.rms_norm import check_norm_args


@dataclass(frozen=True)
class Norm:
    """The RMSNorm a GEMV applies to its x: weight [K], eps, and the residual [1, K] added first
    (None in the first layer, whose x is the embedding)."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None


@triton.jit
def norm_rstd(x_ptr, res_ptr, res_out_ptr, K, eps, STORE, HAS_RESIDUAL: tl.constexpr, BLOCK):
    """rsqrt(mean(s^2) + eps) of the row s = x (+ residual, rounded to x's dtype) in fp32; where
    STORE (one program), s is also written to res_out."""
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    store_end = tl.where(STORE, K, 0)  # the columns this program stores
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_ptr + cols, mask=mask, other=0.0)
        s = x.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            s = (s + r).to(x.dtype).to(tl.float32)  # rounded like a model-dtype add
            tl.store(res_out_ptr + cols, s.to(x.dtype), mask=cols < store_end)
        ss += s * s
    return tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def normed(x, r, w, rstd, DT: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """rms_norm's output element in fp32 from fp32 x, residual r and weight w (norm_row's
    roundings: s, s * rstd and the product with w each rounded to DT)."""
    s = x
    if HAS_RESIDUAL:
        s = (x + r).to(DT).to(tl.float32)
    return ((s * rstd).to(DT).to(tl.float32) * w).to(DT).to(tl.float32)


@triton.jit
def gemv_x8(
    x_ptr,
    res_ptr,
    nw_ptr,
    first,
    rstd,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ASM: tl.constexpr,
):
    """load_x8 of the quantized GEMVs: x[first + i], i < 8, as eight fp32 tensors; with NORM the
    normed values of hidden (x_ptr) and residual."""
    x = load_x8(x_ptr, first, ASM)
    if not NORM:
        return x
    DT: tl.constexpr = x_ptr.dtype.element_ty
    w = load_x8(nw_ptr, first, ASM)
    r = x
    if HAS_RESIDUAL:
        r = load_x8(res_ptr, first, ASM)
    return (
        normed(x[0], r[0], w[0], rstd, DT, HAS_RESIDUAL),
        normed(x[1], r[1], w[1], rstd, DT, HAS_RESIDUAL),
        normed(x[2], r[2], w[2], rstd, DT, HAS_RESIDUAL),
        normed(x[3], r[3], w[3], rstd, DT, HAS_RESIDUAL),
        normed(x[4], r[4], w[4], rstd, DT, HAS_RESIDUAL),
        normed(x[5], r[5], w[5], rstd, DT, HAS_RESIDUAL),
        normed(x[6], r[6], w[6], rstd, DT, HAS_RESIDUAL),
        normed(x[7], r[7], w[7], rstd, DT, HAS_RESIDUAL),
    )


@triton.jit
def gemv_x32(
    x_ptr,
    res_ptr,
    nw_ptr,
    first,
    rstd,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ASM: tl.constexpr,
):
    """x[first + i], i < 32, as 32 fp32 tensors (bits.quant_x16's input), normed with NORM."""
    return (
        gemv_x8(x_ptr, res_ptr, nw_ptr, first, rstd, NORM, HAS_RESIDUAL, ASM)
        + gemv_x8(x_ptr, res_ptr, nw_ptr, first + 8, rstd, NORM, HAS_RESIDUAL, ASM)
        + gemv_x8(x_ptr, res_ptr, nw_ptr, first + 16, rstd, NORM, HAS_RESIDUAL, ASM)
        + gemv_x8(x_ptr, res_ptr, nw_ptr, first + 24, rstd, NORM, HAS_RESIDUAL, ASM)
    )


def norm_args(x: torch.Tensor, norm: Norm | None, K: int):
    """(x as the kernel reads it, the pointers res_ptr, nw_ptr, res_out_ptr, the keyword
    arguments eps and the norm's constexprs, the new residual) of a GEMV launch on x [1, K];
    without a norm, arguments that leave the kernel as it was."""
    x = aligned_x(x)
    if norm is None:
        kw = dict(eps=0.0, NORM=False, HAS_RESIDUAL=False, NORM_BLOCK=1)
        return x, (x, x, x), kw, x
    check_norm_args(x, norm.weight, norm.residual)
    weight = aligned_x(norm.weight)
    if x.shape != (1, K) or weight.stride(0) != 1 or x.stride(1) != 1:
        raise ValueError(
            f"a GEMV with a fused norm needs hidden as one contiguous row [1, {K}], got "
            f"{tuple(x.shape)}"
        )
    res, res_out = x, x  # without a residual, the new residual is hidden itself
    if norm.residual is not None:
        res = aligned_x(norm.residual.contiguous())
        res_out = torch.empty_like(x)
    kw = dict(
        eps=float(norm.eps),
        NORM=True,
        HAS_RESIDUAL=norm.residual is not None,
        NORM_BLOCK=min(triton.next_power_of_2(K), 4096),  # Qwen3's rows in one or two steps
    )
    return x, (res, weight, res_out), kw, res_out


def gemv_norm_ref(hidden: torch.Tensor, norm: Norm, matmul_ref, *args):
    """(matmul_ref(rms_norm_ref(hidden + residual), *args), the new residual): the fused GEMVs'
    reference in plain torch."""
    from kipp_cuda.kernels.rms_norm import rms_norm_ref

    if norm.residual is None:
        h, res = rms_norm_ref(hidden, norm.weight, norm.eps), hidden
    else:
        h, res = rms_norm_ref(hidden, norm.weight, norm.eps, norm.residual)
    return matmul_ref(h, *args), res
