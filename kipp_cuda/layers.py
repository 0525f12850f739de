"""Linear and embedding layers for dense and weight-only quantized weights (module swaps, gpt-fast
style: the model file stays plain, the quantized classes replace the dense ones at load).

`forward_norm(hidden, residual, weight, eps)` is the residual add + RMSNorm, then the linear: at
decode of one sequence (T = 1) one GEMV launch that norms x as it reads it (kernels/norm_x.py),
else rms_norm and the linear as two launches.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kipp_core.fastpath import kernel_disabled
from kipp_core.quant import check_scheme
from kipp_cuda.kernels import BACKEND, triton_runs_on
from kipp_cuda.kernels.affine_gemv import affine_gemv_norm
from kipp_cuda.kernels.affine_matmul import affine_embedding, affine_matmul
from kipp_cuda.kernels.dense_gemv import dense_gemv, dense_gemv_norm
from kipp_cuda.kernels.norm_x import Norm
from kipp_cuda.kernels.q8_0_gemv import q8_0_gemv_norm
from kipp_cuda.kernels.q8_0_matmul import q8_0_embedding, q8_0_matmul
from kipp_cuda.kernels.rms_norm import rms_norm
from kipp_cuda.kernels.swiglu import silu_and_mul


def fused_norm_enabled() -> bool:
    """Whether a model built now norms inside its one-token GEMVs: only with KIPP_CUDA_FUSED_NORM=1
    (read when the model is built, so a model and its CUDA graphs take one path). Off by
    default: it made an 8B decode step slower (kernels/norm_x.py)."""
    return os.environ.get("KIPP_CUDA_FUSED_NORM", "0").strip() in ("1", "true", "yes")


def _fused_norm_runs(hidden: torch.Tensor, gemv: str) -> bool:
    # one token, the GEMV's kernel and rms_norm's run on this device, neither switched off
    return (
        hidden.shape[0] == 1
        and triton_runs_on(hidden.device.type) is None
        and not kernel_disabled(BACKEND, "rms_norm")
        and not kernel_disabled(BACKEND, gemv)
    )


def _norm_then(linear: nn.Module, hidden, residual, weight, eps):
    # the unfused path: rms_norm (with the residual add), then the linear
    if residual is None:
        return linear(rms_norm(hidden, weight, eps)), hidden
    h, residual = rms_norm(hidden, weight, eps, residual)
    return linear(h), residual


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor, act: bool = False) -> torch.Tensor:
        """x [T, in], or with act=True a gate_up output [T, 2 in] taken through SwiGLU first."""
        if x.shape[0] == 1 and x.is_cuda:  # decode: a streaming GEMV beats cuBLAS at M = 1
            return dense_gemv(x, self.weight, act)  # SwiGLU fused into the GEMV's input
        return torch.nn.functional.linear(silu_and_mul(x) if act else x, self.weight)

    def forward_norm(self, hidden, residual, weight, eps):
        """(self(rms_norm(hidden + residual) * weight), hidden + residual), hidden [T, in]; the
        new residual is hidden itself when residual is None."""
        if hidden.is_cuda and _fused_norm_runs(hidden, "dense_gemv"):
            return dense_gemv_norm(hidden, Norm(weight, eps, residual), self.weight)
        return _norm_then(self, hidden, residual, weight, eps)


class Q8Linear(nn.Module):
    def __init__(self, qs: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("qs", qs)  # int8 [out, in]
        self.register_buffer("scales", scales)  # fp16 [out, in / 32]

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    def forward(self, x: torch.Tensor, act: bool = False) -> torch.Tensor:
        # SwiGLU stays a launch of its own here: fused into the quantized GEMV's reads of x (as
        # dense does) it made an 8B q8_0 step 0.44 ms slower, as each program recomputes the exp
        # of every x; the launch costs 0.04 ms (BENCHMARKS.md, seventh session).
        return q8_0_matmul(silu_and_mul(x) if act else x, self.qs, self.scales)

    def forward_norm(self, hidden, residual, weight, eps):
        """DenseLinear.forward_norm for q8_0 weights."""
        if _fused_norm_runs(hidden, "q8_0_matmul"):
            return q8_0_gemv_norm(hidden, Norm(weight, eps, residual), self.qs, self.scales)
        return _norm_then(self, hidden, residual, weight, eps)


class AffineLinear(nn.Module):
    def __init__(
        self,
        wq: torch.Tensor,
        scales: torch.Tensor,
        biases: torch.Tensor,
        bits: int,
        group_size: int,
    ):
        super().__init__()
        self.register_buffer("wq", wq)  # int32 holding uint32 words [out, in * bits / 32]
        self.register_buffer("scales", scales)  # [out, in / group_size]
        self.register_buffer("biases", biases)
        self.bits, self.group_size = bits, group_size

    @property
    def out_features(self) -> int:
        return self.wq.shape[0]

    def forward(self, x: torch.Tensor, act: bool = False) -> torch.Tensor:
        return affine_matmul(
            silu_and_mul(x) if act else x,
            self.wq,
            self.scales,
            self.biases,
            self.bits,
            self.group_size,
        )

    def forward_norm(self, hidden, residual, weight, eps):
        """DenseLinear.forward_norm for affine weights."""
        if _fused_norm_runs(hidden, "affine_matmul"):
            norm = Norm(weight, eps, residual)
            q = (self.wq, self.scales, self.biases, self.bits, self.group_size)
            return affine_gemv_norm(hidden, norm, *q)
        return _norm_then(self, hidden, residual, weight, eps)


def make_linear(parts: dict[str, torch.Tensor], scheme: str | None) -> nn.Module:
    """parts: {"weight"} for dense, or the quantized parts of kipp_cuda.quant.quantize."""
    if scheme is None:
        return DenseLinear(parts["weight"])
    bits, gs = check_scheme(scheme)
    if scheme == "q8_0":
        return Q8Linear(parts["weight"], parts["scales"])
    return AffineLinear(parts["weight"], parts["scales"], parts["biases"], bits, gs)


def embed(table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows of an embedding stored as any of the linear kinds (tied heads share the table)."""
    if isinstance(table, DenseLinear):
        return torch.nn.functional.embedding(ids, table.weight)
    if isinstance(table, Q8Linear):
        return q8_0_embedding(ids, table.qs, table.scales)
    assert isinstance(table, AffineLinear)
    return affine_embedding(ids, table.wq, table.scales, table.biases, table.bits, table.group_size)
