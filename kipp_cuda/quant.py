"""Quantize weights at load, on the device, exactly as kipp_core.quant's numpy references do.

Divisors are tensors, never Python numbers: on CUDA, torch divides by a Python scalar as a multiply
by its reciprocal, which rounds differently from numpy's division (affine8's 1/255 moved scales by
an ulp, and the at-load model's logits off the stored checkpoint's, on the H200).
"""

from __future__ import annotations

import torch

from kipp_core.quant import QK8_0, check_scheme


def _const(x: float, device: torch.device) -> torch.Tensor:
    """x as a float32 tensor on `device`: a true divisor (see the top)."""
    return torch.tensor(x, dtype=torch.float32, device=device)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> qs int8 [N, K], d fp16 [N, K/32] (ggml quantize_row_q8_0_ref)."""
    wf = w.float().reshape(w.shape[0], -1, QK8_0)
    d = wf.abs().amax(dim=-1) / _const(127.0, w.device)
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    x = wf * inv[..., None]
    qs = (torch.sign(x) * torch.floor(x.abs() + 0.5)).to(torch.int8)  # roundf: half away from 0
    return qs.reshape(w.shape), d.to(torch.float16)


def quantize_affine(w: torch.Tensor, bits: int, group_size: int):
    """w [N, K] -> (wq int32 [N, K*bits/32] (uint32 bits), scales, biases [N, K/gs] in w.dtype);
    MLX's fp32 affine algorithm (see kipp_core.quant.quantize_affine)."""
    g = w.float().reshape(w.shape[0], -1, group_size)
    n_bins = float(2**bits - 1)
    w_max, w_min = g.amax(dim=-1), g.amin(dim=-1)
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / _const(n_bins, w.device), min=1e-7)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)  # torch.round is half to even, like rint
    nz = q0 != 0
    scale = torch.where(nz, edge / torch.where(nz, q0, torch.ones_like(q0)), scale)
    bias = torch.where(nz, edge, torch.zeros_like(edge))
    q = torch.clamp(torch.round((g - bias[..., None]) / scale[..., None]), 0, n_bins)
    q = q.to(torch.int64).reshape(w.shape[0], -1, 32 // bits)
    shifts = torch.arange(32 // bits, device=w.device, dtype=torch.int64) * bits
    packed = (q << shifts).sum(dim=-1)  # disjoint bit fields: sum == bitwise or
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed, scale.to(w.dtype), bias.to(w.dtype)


def interleave_scale_bias(scales: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    """(scales, biases) [N, G] -> sb [N, G, 2]: a group's scale and bias side by side, so the
    one-token GEMV reads both in one 32-bit load (affine_gemv.py's PACKED) instead of two 16-bit
    ones. sb[..., 0] and sb[..., 1] are the scales and biases, as views (every affine kernel
    takes their stride)."""
    return torch.stack([scales, biases], dim=-1)


def quantize(w: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    bits, gs = check_scheme(scheme)
    if scheme == "q8_0":
        qs, d = quantize_q8_0(w)
        return {"weight": qs, "scales": d}
    wq, s, b = quantize_affine(w, bits, gs)
    return {"weight": wq, "scales": s, "biases": b}
