"""RMSNorm with an optional fused residual add (transformers' Qwen3RMSNorm order).

x, residual: [T, H]; weight: [H]. With a residual, s = x + residual rounded to x.dtype (the model
adds in its own dtype) is both returned and normalized. h = s * rsqrt(mean(s^2) + eps) in fp32,
cast to x.dtype, then times the weight with the product rounded to x.dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait

MAX_ROW_WARPS = 16  # a 4096-wide row: 16 warps of 8 values a thread. Tuned in the 8B decode graph
# on an H200 (8 warps: +0.005 ms a step, 4: +0.010; benchmarks/LOG.md, entry 68aa99e)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    H,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per token row; the whole row sits in registers (H <= 8192 for Qwen3).
    t, cols, mask, w, x = load_row(x_ptr, w_ptr, stride_x, H, BLOCK_H, PDL)
    dtype = x.dtype
    s = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (s + r).to(dtype).to(tl.float32)  # rounded like a model-dtype add
        tl.store(res_out_ptr + t * stride_ro + cols, s.to(dtype), mask=mask)
    tl.store(out_ptr + t * stride_o + cols, norm_row(s, w, H, eps, dtype), mask=mask)


@triton.jit
def load_row(x_ptr, w_ptr, stride_x, H, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """(t, cols, mask, w, x): program t's row of x and the norm weight as fp32; the weight is read
    before the PDL wait (no kernel writes it), x after."""
    pdl_trigger(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    return t, cols, mask, w, tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)


@triton.jit
def norm_row(s, w, H, eps, dtype: tl.constexpr):
    """RMSNorm of one fp32 row s (zeros past H) times w, rounded as the model rounds it."""
    var = tl.sum(s * s, axis=0) / H
    h = (s * tl.math.rsqrt(var + eps)).to(dtype).to(tl.float32)
    return (h * w).to(dtype)


def row_launch(H: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps) of a one-row-a-program norm: ~8 elements a thread. Kernels that must
    round like rms_norm use the same pair, so that tl.sum reduces in the same order."""
    block_h = triton.next_power_of_2(H)
    return block_h, min(MAX_ROW_WARPS, max(1, block_h // 256))


def check_norm_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(
            f"rms_norm needs x [T, H] and weight [H], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x "
            f"{tuple(x.shape)} {x.dtype}"
        )


def _rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    check_norm_args(x, weight, residual)
    T, H = x.shape
    if (
        x.stride(-1) != 1
        or weight.stride(-1) != 1
        or (residual is not None and residual.stride(-1) != 1)
    ):
        raise ValueError("rms_norm needs the hidden dimension contiguous")
    out = torch.empty((T, H), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if T == 0:
        return out if residual is None else (out, res_out)
    block_h, num_warps = row_launch(H)
    pdl = launch_kwargs(x.device)
    _rms_norm_kernel[(T,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        res_out,
        H,
        float(eps),
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        res_out.stride(0),
        BLOCK_H=block_h,
        HAS_RESIDUAL=residual is not None,
        num_warps=num_warps,
        PDL=bool(pdl),
        **pdl,
    )
    return out if residual is None else (out, res_out)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    check_norm_args(x, weight, residual)
    s = x if residual is None else (x + residual).to(x.dtype)
    h = s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + eps)
    out = (h.to(x.dtype).float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, s)


rms_norm = dispatch("rms_norm", _rms_norm_op, rms_norm_ref)


def bench_specs(device: str = "cuda") -> list[dict]:
    """Qwen3 0.6B / 8B hidden sizes, decode to prefill, with the residual add as the model runs."""
    from kipp_cuda.kernels.bench import MODELS, TOKENS

    specs = []
    for model, (H, *_) in MODELS.items():
        for T in TOKENS:
            x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
            r = torch.randn_like(x)
            w = torch.randn(H, device=device, dtype=torch.bfloat16)
            args = (x, w, 1e-6, r)
            specs.append(
                {
                    "name": "rms_norm+residual",
                    "kernels": ["rms_norm"],
                    "shape": f"{model} T={T} H={H}",
                    "fn": lambda a=args: rms_norm(*a),
                    "ref": lambda a=args: rms_norm_ref(*a),
                    "bytes": 4 * T * H * 2 + H * 2,
                    "flops": 0,
                }
            )
    return specs
