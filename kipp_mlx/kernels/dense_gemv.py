"""x @ W.T for a few rows of x (decode) with W a dense [N, K] matrix of the model dtype.

`_CUDA` (with a Metal twin `_METAL`), `dense_gemv` (checks and launches) and `dense_gemv_ref`
(a float32 matmul). A warp takes ROWS rows of W and all M rows of x; lane l takes the 16-byte
vectors l, l + 32, ... of each row, so a warp reads 512 contiguous bytes of a row a step and each
weight once for all M rows of x. Products are summed in float32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

MAX_ROWS_X = 8
DEFAULT_CONFIG = (2, 4)  # (ROWS a warp, WARPS a block)

# x [MM, K] T; w [N, K] T; out [MM, N] T
_CUDA = """
    constexpr int VEC = 16 / sizeof(T);
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int NV = K / VEC;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
    if (row0 >= N) return;
    float acc[ROWS][MM];
    for (int r = 0; r < ROWS; r++) for (int m = 0; m < MM; m++) acc[r][m] = 0.0f;
    for (int v = lane; v < NV; v += 32) {
        uint4 wv[ROWS];
        for (int r = 0; r < ROWS; r++) {
            const int row = min(row0 + r, N - 1);
            wv[r] = *reinterpret_cast<const uint4*>(w + (size_t)row * K + v * VEC);
        }
        for (int m = 0; m < MM; m++) {
            const uint4 ux = *reinterpret_cast<const uint4*>(x + (size_t)m * K + v * VEC);
            const T* ex = reinterpret_cast<const T*>(&ux);
            float xf[VEC];
            for (int i = 0; i < VEC; i++) xf[i] = static_cast<float>(ex[i]);
            for (int r = 0; r < ROWS; r++) {
                const T* ew = reinterpret_cast<const T*>(&wv[r]);
                float s = 0.0f;
                for (int i = 0; i < VEC; i++) s += xf[i] * static_cast<float>(ew[i]);
                acc[r][m] += s;
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        for (int m = 0; m < MM; m++) {
            float s = acc[r][m];
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
            if (lane == 0 && row0 + r < N) out[(size_t)m * N + row0 + r] = static_cast<T>(s);
        }
    }
"""

_METAL = """
    constexpr int VEC = 16 / sizeof(T);
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int NV = K / VEC;
    const int tid = thread_position_in_threadgroup.x;
    const int warp = tid / 32, lane = tid % 32;
    const int row0 = (threadgroup_position_in_grid.x * WARPS + warp) * ROWS;
    if (row0 >= N) return;
    float acc[ROWS][MM];
    for (int r = 0; r < ROWS; r++) for (int m = 0; m < MM; m++) acc[r][m] = 0.0f;
    for (int v = lane; v < NV; v += 32) {
        for (int m = 0; m < MM; m++) {
            float xf[VEC];
            for (int i = 0; i < VEC; i++) xf[i] = float(x[(size_t)m * K + v * VEC + i]);
            for (int r = 0; r < ROWS; r++) {
                const int row = min(row0 + r, N - 1);
                float s = 0.0f;
                for (int i = 0; i < VEC; i++) s += xf[i] * float(w[(size_t)row * K + v * VEC + i]);
                acc[r][m] += s;
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        for (int m = 0; m < MM; m++) {
            const float s = simd_sum(acc[r][m]);
            if (lane == 0 && row0 + r < N) out[(size_t)m * N + row0 + r] = static_cast<T>(s);
        }
    }
"""

_built: dict[str, object] = {}


def _kernel(kind: str):
    if kind not in _built:
        make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
        src = _METAL if kind == "metal" else _CUDA
        _built[kind] = make("kipp_dense_gemv", ["x", "w"], ["out"], src)
    return _built[kind]


def dense_gemv(
    x: mx.array, w: mx.array, kind: str = "cuda", config: tuple[int, int] | None = None
) -> mx.array:
    """x [..., K] (at most MAX_ROWS_X rows) @ w [N, K].T -> [..., N] in x's dtype."""
    K = x.shape[-1]
    N = w.shape[0]
    if w.ndim != 2 or w.shape[1] != K or w.dtype != x.dtype or K % (16 // x.dtype.size):
        raise ValueError(f"dense_gemv: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}")
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_ROWS_X:
        raise ValueError(f"dense_gemv takes at most {MAX_ROWS_X} rows of x, got {M}")
    rows, warps = config or DEFAULT_CONFIG
    out = _kernel(kind)(
        inputs=[x2, w],
        template=[("T", x.dtype), ("MM", M), ("ROWS", rows), ("WARPS", warps)],
        grid=(-(-N // (rows * warps)) * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )[0]
    return out.reshape(*x.shape[:-1], N)


def dense_gemv_ref(x: mx.array, w: mx.array, **_) -> mx.array:
    return (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(x.dtype)


def probe_inputs(dtype, rows_x: int = 3, seed: int = 0):
    """K = 200 (not a multiple of 32 lanes' vectors), N = 37."""
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((37, 200)).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((rows_x, 200)).astype(np.float32)).astype(dtype)
    return x, w
