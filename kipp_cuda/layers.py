"""Linear and embedding layers for dense and weight-only quantized weights (module swaps, gpt-fast
style: the model file stays plain, the quantized classes replace the dense ones at load)."""

from __future__ import annotations

import torch
from torch import nn

from kipp_core.quant import check_scheme
from kipp_cuda.kernels.affine_matmul import affine_matmul
from kipp_cuda.kernels.dense_gemv import dense_gemv
from kipp_cuda.kernels.embedding import affine_embedding, dense_embedding, q8_0_embedding
from kipp_cuda.kernels.head_argmax import check_head, head_ref
from kipp_cuda.kernels.q8_0_matmul import q8_0_matmul
from kipp_cuda.kernels.swiglu import silu_and_mul
from kipp_cuda.quant import interleave_scale_bias


class DenseLinear(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(
        self, x: torch.Tensor, act: bool = False, head_keys: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, in], or with act=True a gate_up output [T, 2 in] taken through SwiGLU first.
        head_keys (T = 1, the vocabulary head; kernels/head_argmax.py): fp32 logits, and the
        running argmax key in head_keys[0] for finish_argmax."""
        check_head(head_keys, x.shape[0], act)
        if x.shape[0] == 1 and x.is_cuda:  # decode: a streaming GEMV beats cuBLAS at M = 1
            # SwiGLU fused into the GEMV's input; head mode into its epilogue
            return dense_gemv(x, self.weight, act, head_keys=head_keys)
        out = torch.nn.functional.linear(silu_and_mul(x) if act else x, self.weight)
        return head_ref(out, head_keys)


class _QuantLinear(nn.Module):
    """A weight-only quantized linear layer; a subclass gives `_matmul`."""

    def forward(
        self,
        x: torch.Tensor,
        act: bool = False,
        swiglu: bool = False,
        head_keys: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """act: x is a gate_up output taken through SwiGLU first; swiglu: this is gate_up and
        returns SwiGLU of its output (swiglu_mlp); head_keys as DenseLinear's."""
        check_head(head_keys, x.shape[0], act or swiglu)
        x = silu_and_mul(x) if act else x
        return self._matmul(x, swiglu, head_keys)


class Q8Linear(_QuantLinear):
    def __init__(self, qs: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.register_buffer("qs", qs)  # int8 [out, in]
        self.register_buffer("scales", scales)  # fp16 [out, in / 32]

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    def _matmul(self, x, swiglu, head_keys):
        return q8_0_matmul(x, self.qs, self.scales, swiglu=swiglu, head_keys=head_keys)


class AffineLinear(_QuantLinear):
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
        self.register_buffer("scale_bias", interleave_scale_bias(scales, biases))  # [out, G, 2]
        self.bits, self.group_size = bits, group_size

    @property
    def scales(self) -> torch.Tensor:  # [out, in / group_size], a view with stride 2
        return self.scale_bias[..., 0]

    @property
    def biases(self) -> torch.Tensor:
        return self.scale_bias[..., 1]

    @property
    def out_features(self) -> int:
        return self.wq.shape[0]

    def _matmul(self, x, swiglu, head_keys):
        w = (self.wq, self.scales, self.biases, self.bits, self.group_size)
        return affine_matmul(x, *w, swiglu=swiglu, head_keys=head_keys)


def swiglu_mlp(gate_up: nn.Module, down: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) * up) with gate, up = gate_up(h) (gate_up's rows: gate, then up). At T = 1
    SwiGLU rides in a GEMV: the dense down GEMV's reads of x, and the quantized gate_up GEMV's
    epilogue. A quantized GEMV cannot take it in its reads of x cheaply: each of its programs
    would recompute every exp (+0.44 ms an 8B q8_0 step: benchmarks/LOG.md, entry 752bd46)."""
    if isinstance(gate_up, DenseLinear):
        return down(gate_up(h), act=True)
    return down(gate_up(h, swiglu=True))


def make_linear(parts: dict[str, torch.Tensor], scheme: str | None) -> nn.Module:
    """parts: {"weight"} for dense, or the quantized parts of kipp_cuda.quant.quantize."""
    if scheme is None:
        return DenseLinear(parts["weight"])
    bits, gs = check_scheme(scheme)
    if scheme == "q8_0":
        return Q8Linear(parts["weight"], parts["scales"])
    return AffineLinear(parts["weight"], parts["scales"], parts["biases"], bits, gs)


def embed(table: nn.Module, ids: torch.Tensor, dtype: torch.dtype, take_last=None) -> torch.Tensor:
    """Rows of an embedding stored as any of the linear kinds (tied heads share the table), in
    dtype, in one launch (kernels/embedding.py); take_last=(flags, last) replaces ids[t] by
    last[t] where flags[t] != 0 (a decode graph's PENDING ids)."""
    if isinstance(table, DenseLinear):
        return dense_embedding(ids, table.weight, dtype, take_last=take_last)
    if isinstance(table, Q8Linear):
        return q8_0_embedding(ids, table.qs, table.scales, dtype, take_last=take_last)
    assert isinstance(table, AffineLinear)
    w = (table.wq, table.scales, table.biases, table.bits, table.group_size)
    return affine_embedding(ids, *w, dtype, take_last=take_last)
