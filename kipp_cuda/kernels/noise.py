"""The sampler's deterministic uniform noise (kipp_core.sampling.uniform), a batch of rows at once.

Row b has the host-computed keys k1[b], k2[b] (kipp_core.sampling.noise_keys). Element i, in
wrap-around uint32 arithmetic: h = fmix32(k1 ^ fmix32(i * 0x9E3779B9 + k2)); u = (float32(h >> 9)
+ 0.5) * 2**-23, with fmix32(h): h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35;
h ^= h >> 16. Equal to the numpy reference bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch

M32 = 0xFFFFFFFF
_C1, _C2, _IDX_MUL = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h *= tl.full((), 0x85EBCA6B, tl.uint32)
    h ^= h >> 13
    h *= tl.full((), 0xC2B2AE35, tl.uint32)
    return h ^ (h >> 16)


@triton.jit
def _uniform_rows_kernel(
    k1_ptr,
    k2_ptr,
    out_ptr,
    n,
    stride_o,
    BLOCK: tl.constexpr,
):
    # Program (row, block of columns); all hashing in uint32, which wraps like numpy's.
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    k1 = tl.load(k1_ptr + b).to(tl.uint32)
    k2 = tl.load(k2_ptr + b).to(tl.uint32)
    i = cols.to(tl.uint32)
    h = _fmix32(k1 ^ _fmix32(i * tl.full((), 0x9E3779B9, tl.uint32) + k2))
    u = ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    tl.store(out_ptr + b * stride_o + cols, u, mask=cols < n)


def _check(k1: torch.Tensor, k2: torch.Tensor, n: int) -> None:
    if k1.dim() != 1 or k1.shape != k2.shape or k1.dtype != torch.int64 or k2.dtype != torch.int64:
        raise ValueError(
            f"k1, k2 must be int64 [B], got {k1.dtype} {tuple(k1.shape)} and "
            f"{k2.dtype} {tuple(k2.shape)}"
        )
    if n < 0 or n > 2**32:
        raise ValueError(f"n must be in [0, 2**32], got {n}")


def _uniform_rows_op(k1: torch.Tensor, k2: torch.Tensor, n: int) -> torch.Tensor:
    _check(k1, k2, n)
    out = torch.empty((k1.shape[0], n), dtype=torch.float32, device=k1.device)
    if out.numel() == 0:
        return out
    block = min(2048, triton.next_power_of_2(n))
    _uniform_rows_kernel[(k1.shape[0], triton.cdiv(n, block))](
        k1.contiguous(),
        k2.contiguous(),
        out,
        n,
        out.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return out


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    # a * c mod 2**32 for a in [0, 2**32) without leaving int64: split c into 16-bit halves.
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & M32


def _fmix32_ref(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _C1)
    h = h ^ (h >> 13)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def uniform_rows_ref(k1: torch.Tensor, k2: torch.Tensor, n: int) -> torch.Tensor:
    """The same hash in int64 torch ops, masked to 32 bits after every multiply."""
    _check(k1, k2, n)
    i = torch.arange(n, dtype=torch.int64, device=k1.device)[None, :]
    k1, k2 = (k1 & M32)[:, None], (k2 & M32)[:, None]
    h = _fmix32_ref(k1 ^ _fmix32_ref((_mul32(i, _IDX_MUL) + k2) & M32))
    return ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23


uniform_rows = dispatch("uniform_rows", _uniform_rows_op, uniform_rows_ref)


def bench_specs(device: str = "cuda") -> list[dict]:
    """A batch of 1 and of 64 rows over Qwen3's vocabulary."""
    from kipp_cuda.kernels.bench import VOCAB

    specs = []
    for B in (1, 64):
        k1 = torch.randint(0, 2**32, (B,), device=device, dtype=torch.int64)
        k2 = torch.randint(0, 2**32, (B,), device=device, dtype=torch.int64)
        args = (k1, k2, VOCAB)
        specs.append(
            {
                "name": "uniform_rows",
                "shape": f"B={B} V={VOCAB}",
                "fn": lambda a=args: uniform_rows(*a),
                "ref": lambda a=args: uniform_rows_ref(*a),
                "bytes": B * VOCAB * 4,
                "flops": 0,
            }
        )
    return specs
