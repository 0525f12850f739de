"""SwiGLU on the fused gate_up projection: silu(gate) * up, in one launch.

`_CUDA` (with a Metal twin `_METAL`), `swiglu` (checks and launches) and `swiglu_ref` (MLX ops,
as transformers: silu in the model dtype, then the product rounded once more). A thread takes 8
consecutive outputs (one row's when the intermediate size is a multiple of 8, read and written
as 16-byte vectors in 16-bit dtypes on CUDA; else it steps into the next row), finding its row
with one division; the float32 math rounds where transformers' bf16 ops round.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

PER_THREAD = 8

# gate_up [T, 2 I] -> out [T, I]
_CUDA = """
    const int I = gate_up_shape[1] / 2;
    const size_t e0 = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    const size_t total = (size_t)gate_up_shape[0] * I;
    if (e0 >= total) return;
    // one division a thread: with the width a multiple of 8, its 8 outputs are one row's
    size_t t = e0 / I, i = e0 % I;
    if (sizeof(T) == 2 && I % 8 == 0) {  // then gate, up and out are 16-byte vectors
        const uint4 gv = *reinterpret_cast<const uint4*>(gate_up + t * 2 * I + i);
        const uint4 uv = *reinterpret_cast<const uint4*>(gate_up + t * 2 * I + I + i);
        const T* g8 = reinterpret_cast<const T*>(&gv);
        const T* u8 = reinterpret_cast<const T*>(&uv);
        uint4 ov;
        T* o8 = reinterpret_cast<T*>(&ov);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float g = static_cast<float>(g8[k]);
            const float silu = static_cast<float>(static_cast<T>(g / (1.0f + expf(-g))));
            o8[k] = static_cast<T>(silu * static_cast<float>(u8[k]));
        }
        *reinterpret_cast<uint4*>(out + e0) = ov;
        return;
    }
    for (int k = 0; k < 8 && e0 + k < total; k++, i++) {
        if (i == I) { t++; i = 0; }
        const float g = static_cast<float>(gate_up[t * 2 * I + i]);
        const float u = static_cast<float>(gate_up[t * 2 * I + I + i]);
        const float silu = static_cast<float>(static_cast<T>(g / (1.0f + expf(-g))));
        out[e0 + k] = static_cast<T>(silu * u);
    }
"""

_METAL = """
    const int I = gate_up_shape[1] / 2;
    const size_t e0 = (size_t)thread_position_in_grid.x * 8;
    const size_t total = (size_t)gate_up_shape[0] * I;
    if (e0 >= total) return;
    size_t t = e0 / I, i = e0 % I;
    for (int k = 0; k < 8 && e0 + k < total; k++, i++) {
        if (i == I) { t++; i = 0; }
        const float g = float(gate_up[t * 2 * I + i]);
        const float u = float(gate_up[t * 2 * I + I + i]);
        const float silu = float(static_cast<T>(g / (1.0f + metal::precise::exp(-g))));
        out[e0 + k] = static_cast<T>(silu * u);
    }
"""

_built: dict[str, object] = {}


def _kernel(kind: str):
    if kind not in _built:
        make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
        src = _METAL if kind == "metal" else _CUDA
        _built[kind] = make("kipp_swiglu", ["gate_up"], ["out"], src)
    return _built[kind]


def swiglu(gate_up: mx.array, kind: str = "cuda") -> mx.array:
    """gate_up [T, 2 I] (gate, then up) -> silu(gate) * up, [T, I]."""
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"swiglu needs [T, 2 I], got {gate_up.shape}")
    T, two_i = gate_up.shape
    n = T * (two_i // 2)
    threads = -(-n // PER_THREAD)
    return _kernel(kind)(
        inputs=[gate_up],
        template=[("T", gate_up.dtype)],
        grid=(threads, 1, 1),
        threadgroup=(min(256, threads), 1, 1),
        output_shapes=[(T, two_i // 2)],
        output_dtypes=[gate_up.dtype],
    )[0]


def swiglu_ref(gate_up: mx.array, **_) -> mx.array:
    gate, up = mx.split(gate_up, 2, axis=-1)
    return nn.silu(gate) * up


def probe_inputs(dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (mx.array(rng.standard_normal((3, 2 * 200)).astype(np.float32) * 3).astype(dtype),)
