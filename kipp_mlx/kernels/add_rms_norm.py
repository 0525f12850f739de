"""The residual add and the RMSNorm after it, in one launch: h = x + r, y = weight * norm(h).

`_CUDA` (with a Metal twin `_METAL`), `add_rms_norm` (checks and launches) and
`add_rms_norm_ref` (MLX ops). One 256-thread block a row, 16-byte loads; h is rounded to the model
dtype first (transformers adds the residual in that dtype), its statistics are float32, and the
normed row is cast to the model dtype before the weight multiplies it (Qwen3RMSNorm).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

THREADS = 256

# x, r [T, H]; weight [H]; eps [1] float32 -> h_out, y_out [T, H]
_CUDA = """
    constexpr int VEC = 16 / sizeof(T);
    constexpr int NV = H / VEC;
    constexpr int PER = (NV + 255) / 256;
    const int row = blockIdx.x, tid = threadIdx.x;
    __shared__ float part[8];
    float hv[PER][VEC];
    float ss = 0.0f;
    for (int p = 0; p < PER; p++) {
        const int v = tid + 256 * p;
        if (v >= NV) break;
        const size_t off = (size_t)row * H + v * VEC;
        const uint4 ux = *reinterpret_cast<const uint4*>(x + off);
        const uint4 ur = *reinterpret_cast<const uint4*>(r + off);
        const T* ex = reinterpret_cast<const T*>(&ux);
        const T* er = reinterpret_cast<const T*>(&ur);
        uint4 uh;
        T* eh = reinterpret_cast<T*>(&uh);
        for (int i = 0; i < VEC; i++) {
            eh[i] = static_cast<T>(static_cast<float>(ex[i]) + static_cast<float>(er[i]));
            hv[p][i] = static_cast<float>(eh[i]);
            ss += hv[p][i] * hv[p][i];
        }
        *reinterpret_cast<uint4*>(h_out + off) = uh;
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if (tid % 32 == 0) part[tid / 32] = ss;
    __syncthreads();
    float total = 0.0f;
    for (int i = 0; i < 8; i++) total += part[i];
    const float rs = rsqrtf(total / H + eps[0]);
    for (int p = 0; p < PER; p++) {
        const int v = tid + 256 * p;
        if (v >= NV) break;
        const size_t off = (size_t)row * H + v * VEC;
        const uint4 uw = *reinterpret_cast<const uint4*>(weight + v * VEC);
        const T* ew = reinterpret_cast<const T*>(&uw);
        uint4 uy;
        T* ey = reinterpret_cast<T*>(&uy);
        for (int i = 0; i < VEC; i++) {
            const float normed = static_cast<float>(static_cast<T>(hv[p][i] * rs));
            ey[i] = static_cast<T>(static_cast<float>(ew[i]) * normed);
        }
        *reinterpret_cast<uint4*>(y_out + off) = uy;
    }
"""

_METAL = """
    const int row = threadgroup_position_in_grid.x;
    const int tid = thread_position_in_threadgroup.x;
    constexpr int PER = (H + 255) / 256;
    threadgroup float part[8];
    float hv[PER];
    float ss = 0.0f;
    for (int p = 0; p < PER; p++) {
        const int i = tid + 256 * p;
        if (i >= H) break;
        const size_t off = (size_t)row * H + i;
        const T h = static_cast<T>(float(x[off]) + float(r[off]));
        h_out[off] = h;
        hv[p] = float(h);
        ss += hv[p] * hv[p];
    }
    ss = simd_sum(ss);
    if (tid % 32 == 0) part[tid / 32] = ss;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (int i = 0; i < 8; i++) total += part[i];
    const float rs = metal::precise::rsqrt(total / H + eps[0]);
    for (int p = 0; p < PER; p++) {
        const int i = tid + 256 * p;
        if (i >= H) break;
        const float normed = float(static_cast<T>(hv[p] * rs));
        y_out[(size_t)row * H + i] = static_cast<T>(float(weight[i]) * normed);
    }
"""

_built: dict[str, object] = {}
_eps: dict[float, mx.array] = {}  # one device scalar an eps, not one upload a call


def _kernel(kind: str):
    if kind not in _built:
        make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
        src = _METAL if kind == "metal" else _CUDA
        _built[kind] = make(
            "kipp_add_rms_norm", ["x", "r", "weight", "eps"], ["h_out", "y_out"], src
        )
    return _built[kind]


def add_rms_norm(
    x: mx.array, r: mx.array, weight: mx.array, eps: float, kind: str = "cuda"
) -> tuple[mx.array, mx.array]:
    """x, r [T, H] -> (x + r, rms_norm(x + r) * weight), both [T, H] in x's dtype."""
    T, H = x.shape
    if r.shape != x.shape or weight.shape != (H,) or H % (16 // x.dtype.size):
        raise ValueError(f"add_rms_norm: x {x.shape}, r {r.shape}, weight {weight.shape}")
    if eps not in _eps:
        _eps[eps] = mx.array([eps], mx.float32)
    if r.dtype != x.dtype or weight.dtype != x.dtype:
        raise ValueError(f"add_rms_norm: x {x.dtype}, r {r.dtype}, weight {weight.dtype} differ")
    return tuple(
        _kernel(kind)(
            inputs=[x, r, weight, _eps[eps]],
            template=[("T", x.dtype), ("H", H)],
            grid=(T * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[x.shape, x.shape],
            output_dtypes=[x.dtype, x.dtype],
        )
    )


def add_rms_norm_ref(x, r, weight, eps: float, **_) -> tuple[mx.array, mx.array]:
    h = (x.astype(mx.float32) + r.astype(mx.float32)).astype(x.dtype)
    hf = h.astype(mx.float32)
    rs = mx.rsqrt(mx.mean(hf * hf, axis=-1, keepdims=True) + eps)
    y = (weight.astype(mx.float32) * (hf * rs).astype(x.dtype).astype(mx.float32)).astype(x.dtype)
    return h, y


def probe_inputs(hidden_size: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((3, hidden_size)).astype(np.float32) * 4).astype(dtype)
    r = mx.array(rng.standard_normal((3, hidden_size)).astype(np.float32)).astype(dtype)
    w = mx.array(rng.uniform(0.5, 1.5, hidden_size).astype(np.float32)).astype(dtype)
    return x, r, w, 1e-6
