"""x @ W.T with W in ggml q8_0 (int8 values, one fp16 scale per 32 along a row).

`_q8_0_matmul_kernel` (Metal, with a CUDA twin), `q8_0_matmul` (checks and launches) and
`q8_0_matmul_ref` (dequantize, then a float matmul). One 32-thread group per output element; each
lane takes every 32nd block of the row, multiplies in float32 and scales once per block, then the
group sums. It reads each weight once per input row, so it serves decode; wider inputs (prefill)
go through the reference, where one dequantized gemm is cheaper.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kipp_mlx.quant import dequantize_q8_0

MAX_KERNEL_ROWS = 8

# x: [M, K]; qs: [N, K] int8; d: [N, K / 32] float16; out: [M, N]
_METAL = """
    const uint n = threadgroup_position_in_grid.x;
    const uint m = threadgroup_position_in_grid.y;
    const uint lane = thread_position_in_threadgroup.x;
    const int K = x_shape[1];
    const int N = qs_shape[0];
    const int NB = K / 32;
    float acc = 0.0f;
    for (int blk = lane; blk < NB; blk += 32) {
        const size_t xo = (size_t)m * K + blk * 32;
        const size_t wo = (size_t)n * K + blk * 32;
        float s = 0.0f;
        for (int j = 0; j < 32; j++) {
            s += float(x[xo + j]) * float(qs[wo + j]);
        }
        acc += s * float(d[(size_t)n * NB + blk]);
    }
    acc = simd_sum(acc);
    if (lane == 0) {
        out[(size_t)m * N + n] = static_cast<T>(acc);
    }
"""

_CUDA = """
    const int n = blockIdx.x;
    const int m = blockIdx.y;
    const int lane = threadIdx.x;
    const int K = x_shape[1];
    const int N = qs_shape[0];
    const int NB = K / 32;
    float acc = 0.0f;
    for (int blk = lane; blk < NB; blk += 32) {
        const size_t xo = (size_t)m * K + blk * 32;
        const size_t wo = (size_t)n * K + blk * 32;
        float s = 0.0f;
        for (int j = 0; j < 32; j++) {
            s += static_cast<float>(x[xo + j]) * static_cast<float>(qs[wo + j]);
        }
        acc += s * static_cast<float>(d[(size_t)n * NB + blk]);
    }
    for (int o = 16; o > 0; o >>= 1) {
        acc += __shfl_xor_sync(0xffffffff, acc, o);
    }
    if (lane == 0) {
        out[(size_t)m * N + n] = static_cast<T>(acc);
    }
"""

_built: dict[str, object] = {}


def _q8_0_matmul_kernel(kind: str):
    if kind not in _built:
        make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
        _built[kind] = make(
            "kipp_q8_0_matmul", ["x", "qs", "d"], ["out"], _METAL if kind == "metal" else _CUDA
        )
    return _built[kind]


def q8_0_matmul(x: mx.array, qs: mx.array, d: mx.array, kind: str = "metal") -> mx.array:
    """x [..., K] @ dequant(qs [N, K], d [N, K / 32]).T -> [..., N] in x's dtype."""
    K = x.shape[-1]
    N = qs.shape[0]
    if qs.shape != (N, K) or d.shape != (N, K // 32) or K % 32 or qs.dtype != mx.int8:
        raise ValueError(f"q8_0_matmul: x {x.shape}, qs {qs.shape} {qs.dtype}, d {d.shape}")
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_KERNEL_ROWS:
        return q8_0_matmul_ref(x, qs, d)
    out = _q8_0_matmul_kernel(kind)(
        inputs=[x2, qs, d],
        template=[("T", x.dtype)],
        grid=(N * 32, M, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )[0]
    return out.reshape(*x.shape[:-1], N)


def q8_0_matmul_ref(x: mx.array, qs: mx.array, d: mx.array) -> mx.array:
    w = dequantize_q8_0(qs, d, mx.float32)
    return (x.astype(mx.float32) @ w.T).astype(x.dtype)


def probe_inputs(dtype, seed: int = 0):
    """Awkward shapes: 3 rows, K = 96 (3 blocks, fewer than 32 lanes), N = 37."""
    from kipp_mlx.quant import quantize_q8_0

    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((37, 96)).astype(np.float32))
    qs, d = quantize_q8_0(w)
    x = mx.array(rng.standard_normal((3, 96)).astype(np.float32)).astype(dtype)
    return x, qs, d
