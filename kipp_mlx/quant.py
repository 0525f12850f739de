"""Quantized formats in MLX: q8_0 (ggml) for weights and the KV cache, its exact conversion to MLX
affine 8-bit (how q8_0 weights run), and the affine linear and embedding modules. The numpy
references these follow are in kipp_core.quant; parameter names are the on-disk ones (`weight`,
`scales`, `biases`)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

QK8_0 = 32


def quantize_q8_0(x: mx.array) -> tuple[mx.array, mx.array]:
    """x [..., K] -> qs int8 [..., K], d float16 [..., K / 32], as kipp_core.quant.quantize_q8_0:
    d = amax / 127 in float32, qs = roundf(x * (1 / d)), halves away from zero."""
    if x.shape[-1] % QK8_0:
        raise ValueError(f"q8_0 needs rows divisible by 32, got {x.shape[-1]}")
    b = x.astype(mx.float32).reshape(*x.shape[:-1], -1, QK8_0)
    d = mx.max(mx.abs(b), axis=-1) / 127.0
    inv = mx.where(d == 0, 0.0, 1.0 / mx.where(d == 0, 1.0, d))
    y = b * inv[..., None]
    qs = mx.sign(y) * mx.floor(mx.abs(y) + 0.5)
    return qs.astype(mx.int8).reshape(x.shape), d.astype(mx.float16)


def dequantize_q8_0(qs: mx.array, d: mx.array, dtype=mx.float32) -> mx.array:
    b = qs.astype(mx.float32).reshape(*qs.shape[:-1], -1, QK8_0)
    return (b * d.astype(mx.float32)[..., None]).reshape(qs.shape).astype(dtype)


def q8_0_to_affine8(qs: mx.array, d: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The same values in MLX affine 8-bit, group 32: q = qs + 128, scale = d, bias = -128 d.
    Exact: d is fp16 and q < 256, so scale * q and the sum are exact in float32."""
    q = (qs.astype(mx.int32) + 128).astype(mx.uint32)
    q = q.reshape(*qs.shape[:-1], -1, 4)
    packed = q[..., 0] | (q[..., 1] << 8) | (q[..., 2] << 16) | (q[..., 3] << 24)
    scales = d.astype(mx.float32)
    return packed, scales, -128.0 * scales


class AffineLinear(nn.Module):
    """MLX affine quantization (mx.quantized_matmul): `weight` uint32 [out, in * bits / 32],
    `scales`, `biases` [out, in / group_size]. The output keeps the input's dtype. A few rows of x
    (decode) may go to the affine GEMV kernel (`gemv`, attached by the ladder).

    With float32 scales the product runs in float32: MLX's CPU kernel accumulates in the input's
    dtype, which in bfloat16 costs ~5% error over a 1024-long row (and is 10x slower), so the
    loader gives CPU models float32 scales; q8_0's exact conversion has float32 scales too."""

    def __init__(self, weight, scales, biases, bits: int, group_size: int):
        super().__init__()
        self.weight, self.scales, self.biases = weight, scales, biases
        self.bits, self.group_size = bits, group_size
        self.gemv = None  # fn(x, weight, scales, biases, bits)
        self.gemv_rows = 0
        self.dequant_rows = None  # from this many rows of x: dequantize, then a dense GEMM

    @classmethod
    def quantize(cls, w: mx.array, bits: int, group_size: int):
        return cls(*mx.quantize(w, group_size=group_size, bits=bits), bits, group_size)

    def __call__(self, x: mx.array) -> mx.array:
        if self.gemv is not None and x.shape[0] <= self.gemv_rows:
            return self.gemv(x, self.weight, self.scales, self.biases, self.bits)
        dense = self.dequant_rows is not None and x.shape[0] >= self.dequant_rows
        if dense or (x.dtype == mx.float32 and mx.default_device() == mx.gpu):
            # a float32 model computes in float32 (MLX's GPU quantized GEMM may not); a prefill
            # on MLX's CUDA build runs faster through the dense GEMM (ladder.attach)
            w = mx.dequantize(self.weight, self.scales, self.biases, self.group_size, self.bits)
            return (x @ w.astype(x.dtype).T).astype(x.dtype)
        xs = x.astype(mx.float32) if self.scales.dtype == mx.float32 else x
        y = mx.quantized_matmul(
            xs,
            self.weight,
            self.scales,
            self.biases,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
        )
        return y.astype(x.dtype)


class AffineEmbedding(AffineLinear):
    """An affine-quantized embedding; `as_linear` is the tied head."""

    def __init__(self, weight, scales, biases, bits: int, group_size: int, dtype=mx.bfloat16):
        super().__init__(weight, scales, biases, bits, group_size)
        self.dtype = dtype

    def __call__(self, ids: mx.array) -> mx.array:
        # float32 scales, so the rows are not rounded to the scales' dtype before the cast
        s, b = self.scales[ids].astype(mx.float32), self.biases[ids].astype(mx.float32)
        w = mx.dequantize(self.weight[ids], s, b, group_size=self.group_size, bits=self.bits)
        return w.astype(self.dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return AffineLinear.__call__(self, x)
