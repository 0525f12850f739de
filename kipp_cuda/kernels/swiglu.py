"""SwiGLU activation: x [T, 2 * I] (gate, then up) -> silu(gate) * up [T, I], fp32 math."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    I,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, column block).
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    dtype = g.dtype
    g = g.to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * stride_o + cols, y.to(dtype), mask=mask)


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"silu_and_mul needs x [T, 2 * I], got {tuple(x.shape)}")


def _silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    if x.stride(1) != 1:
        raise ValueError("silu_and_mul needs the last dimension contiguous")
    T, I = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    if T == 0 or I == 0:
        return out
    block = min(1024, triton.next_power_of_2(I))
    pdl = launch_kwargs(x.device)
    _silu_and_mul_kernel[(T, triton.cdiv(I, block))](
        x,
        out,
        I,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=4,
        PDL=bool(pdl),
        **pdl,
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    _check(x)
    g, u = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


silu_and_mul = dispatch("silu_and_mul", _silu_and_mul_op, silu_and_mul_ref)


def bench_specs(device: str = "cuda") -> list[dict]:
    """Qwen3 0.6B / 8B intermediate sizes."""
    from kipp_cuda.kernels.bench import MODELS, TOKENS

    specs = []
    for model, (*_, inter) in MODELS.items():
        for T in TOKENS:
            x = torch.randn(T, 2 * inter, device=device, dtype=torch.bfloat16)
            specs.append(
                {
                    "name": "silu_and_mul",
                    "shape": f"{model} T={T} I={inter}",
                    "fn": lambda a=x: silu_and_mul(a),
                    "ref": lambda a=x: silu_and_mul_ref(a),
                    "bytes": 3 * T * inter * 2,
                    "flops": 0,
                }
            )
    return specs
