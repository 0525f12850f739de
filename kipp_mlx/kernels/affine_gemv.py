"""x @ W.T for a few rows of x (decode) with W in MLX's affine format (4 or 8 bits, group 32).

`_affine_gemv_kernel` (CUDA, with a Metal twin of the same algorithm), `affine_gemv` (checks and
launches) and `affine_gemv_ref` (mx.quantized_matmul in float32). Layout, as mx.quantize writes it:
w uint32 [N, K * bits / 32] (element j of a row at bits (j % (32 / bits)) * bits of word
j / (32 / bits)), scales and biases [N, K / 32]; W[n, j] = scale * q + bias.

A warp takes ROWS rows of W and all M rows of x; lane l takes groups l, l + 32, ... of K, UNROLL
of them a pass with every weight load of the pass issued first (more bytes in flight a warp).
Each group's 32 weights are one (4-bit) or two (8-bit) 16-byte loads, read once for all M rows.
A weight becomes an exact float32 by or-ing it into the mantissa of 2^23 and subtracting 2^23;
the products are summed in float32, and each group adds scale * sum(x q) + bias * sum(x) once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

GROUP_SIZE = 32
MAX_ROWS_X = 8  # wider inputs (prefill) go to mx.quantized_matmul, a tiled GEMM
DEFAULT_CONFIG = (2, 4)  # (ROWS a warp, WARPS a block)
UNROLL = 4  # groups a lane loads before it uses them: 4 covers a 4,096-wide row in one pass

# x [MM, K] T; w [N, K * BITS / 32] uint32; scales, biases [N, K / 32] S; out [MM, N] T
_CUDA = """
    constexpr int WPG = BITS;  // uint32 words a group of 32 weights
    constexpr int PER_WORD = 32 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    constexpr int XV = 16 / sizeof(T);  // elements of x in a 16-byte load
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int G = K / 32;
    const int wpr = K / PER_WORD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
    if (row0 >= N) return;
    float acc[ROWS][MM];
    for (int r = 0; r < ROWS; r++) for (int m = 0; m < MM; m++) acc[r][m] = 0.0f;
    // UNROLL groups a lane per pass: all their weight loads are issued before any is used
    for (int g0 = lane; g0 < G; g0 += 32 * UNROLL) {
        uint32_t wv[UNROLL][ROWS][WPG];
        float sc[UNROLL][ROWS], bi[UNROLL][ROWS];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int g = min(g0 + 32 * u, G - 1);  // past G: a repeated group, not summed
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const int row = min(row0 + r, N - 1);  // rows past N compute row N - 1, unwritten
                const uint4* wp = reinterpret_cast<const uint4*>(w + (size_t)row * wpr + g * WPG);
#pragma unroll
                for (int i = 0; i < WPG / 4; i++) {
                    const uint4 v = wp[i];
                    wv[u][r][4 * i] = v.x; wv[u][r][4 * i + 1] = v.y;
                    wv[u][r][4 * i + 2] = v.z; wv[u][r][4 * i + 3] = v.w;
                }
                sc[u][r] = static_cast<float>(scales[(size_t)row * G + g]);
                bi[u][r] = static_cast<float>(biases[(size_t)row * G + g]);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int g = g0 + 32 * u;
            if (g >= G) break;
            for (int m = 0; m < MM; m++) {
                float xf[32];
                float xsum = 0.0f;
                const uint4* xp = reinterpret_cast<const uint4*>(x + (size_t)m * K + g * 32);
#pragma unroll
                for (int i = 0; i < 32 / XV; i++) {
                    const uint4 v = xp[i];
                    const T* e = reinterpret_cast<const T*>(&v);
                    for (int j = 0; j < XV; j++) {
                        xf[XV * i + j] = static_cast<float>(e[j]);
                        xsum += xf[XV * i + j];
                    }
                }
#pragma unroll
                for (int r = 0; r < ROWS; r++) {
                    float dot = 0.0f;
#pragma unroll
                    for (int k = 0; k < WPG; k++) {
                        const uint32_t word = wv[u][r][k];
#pragma unroll
                        for (int i = 0; i < PER_WORD; i++) {
                            const uint32_t qb = ((word >> (BITS * i)) & MASK) | 0x4B000000u;
                            dot += xf[k * PER_WORD + i] * (__uint_as_float(qb) - 8388608.0f);
                        }
                    }
                    acc[r][m] += sc[u][r] * dot + bi[u][r] * xsum;
                }
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        for (int m = 0; m < MM; m++) {
            float v = acc[r][m];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
            if (lane == 0 && row0 + r < N) out[(size_t)m * N + row0 + r] = static_cast<T>(v);
        }
    }
"""

_METAL = """
    constexpr int WPG = BITS;
    constexpr int PER_WORD = 32 / BITS;
    constexpr uint MASK = (1u << BITS) - 1u;
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int G = K / 32;
    const int wpr = K / PER_WORD;
    const int tid = thread_position_in_threadgroup.x;
    const int warp = tid / 32, lane = tid % 32;
    const int row0 = (threadgroup_position_in_grid.x * WARPS + warp) * ROWS;
    if (row0 >= N) return;
    float acc[ROWS][MM];
    for (int r = 0; r < ROWS; r++) for (int m = 0; m < MM; m++) acc[r][m] = 0.0f;
    for (int g = lane; g < G; g += 32) {
        uint wv[ROWS][WPG];
        float sc[ROWS], bi[ROWS];
        for (int r = 0; r < ROWS; r++) {
            const int row = min(row0 + r, N - 1);
            for (int k = 0; k < WPG; k++) wv[r][k] = w[(size_t)row * wpr + g * WPG + k];
            sc[r] = float(scales[(size_t)row * G + g]);
            bi[r] = float(biases[(size_t)row * G + g]);
        }
        for (int m = 0; m < MM; m++) {
            float xf[32];
            float xsum = 0.0f;
            for (int j = 0; j < 32; j++) {
                xf[j] = float(x[(size_t)m * K + g * 32 + j]);
                xsum += xf[j];
            }
            for (int r = 0; r < ROWS; r++) {
                float dot = 0.0f;
                for (int k = 0; k < WPG; k++) {
                    const uint word = wv[r][k];
                    for (int i = 0; i < PER_WORD; i++) {
                        const uint qb = ((word >> (BITS * i)) & MASK) | 0x4B000000u;
                        dot += xf[k * PER_WORD + i] * (as_type<float>(qb) - 8388608.0f);
                    }
                }
                acc[r][m] += sc[r] * dot + bi[r] * xsum;
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        for (int m = 0; m < MM; m++) {
            const float v = simd_sum(acc[r][m]);
            if (lane == 0 && row0 + r < N) out[(size_t)m * N + row0 + r] = static_cast<T>(v);
        }
    }
"""

_built: dict[str, object] = {}


def _affine_gemv_kernel(kind: str):
    if kind not in _built:
        make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
        src = _METAL if kind == "metal" else _CUDA
        _built[kind] = make("kipp_affine_gemv", ["x", "w", "scales", "biases"], ["out"], src)
    return _built[kind]


def affine_gemv(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    bits: int,
    kind: str = "cuda",
    config: tuple[int, int] | None = None,
) -> mx.array:
    """x [..., K] (at most MAX_ROWS_X rows) @ dequant(w).T -> [..., N] in x's dtype."""
    K = x.shape[-1]
    N = w.shape[0]
    if (
        bits not in (4, 8)
        or K % GROUP_SIZE
        or w.shape != (N, K * bits // 32)
        or w.dtype != mx.uint32
        or scales.shape != (N, K // GROUP_SIZE)
        or biases.shape != scales.shape
        or x.dtype not in (mx.bfloat16, mx.float16, mx.float32)
    ):
        raise ValueError(
            f"affine_gemv: x {x.shape} {x.dtype}, w {w.shape} {w.dtype}, scales {scales.shape}, "
            f"bits {bits} (needs 4 or 8 bits, group 32)"
        )
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_ROWS_X:
        raise ValueError(f"affine_gemv takes at most {MAX_ROWS_X} rows of x, got {M}")
    rows, warps = config or DEFAULT_CONFIG
    per_block = rows * warps
    out = _affine_gemv_kernel(kind)(
        inputs=[x2, w, scales, biases],
        template=[
            ("T", x.dtype),
            ("BITS", bits),
            ("MM", M),
            ("ROWS", rows),
            ("WARPS", warps),
            ("UNROLL", UNROLL),
        ],
        grid=(-(-N // per_block) * 32 * warps, 1, 1),
        threadgroup=(32 * warps, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )[0]
    return out.reshape(*x.shape[:-1], N)


def affine_gemv_ref(x, w, scales, biases, bits: int, **_) -> mx.array:
    """mx.quantized_matmul with float32 inputs and scales: MLX's own kernel, float32 sums."""
    y = mx.quantized_matmul(
        x.astype(mx.float32),
        w,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        transpose=True,
        group_size=GROUP_SIZE,
        bits=bits,
    )
    return y.astype(x.dtype)


def probe_inputs(dtype, bits: int = 4, rows_x: int = 3, seed: int = 0):
    """Awkward shapes: K = 96 (3 groups, fewer than 32 lanes), N = 37 (not a multiple of any
    block of rows), rows_x rows of x."""
    rng = np.random.default_rng(seed)
    wf = mx.array(rng.standard_normal((37, 96)).astype(np.float32)).astype(dtype)
    w, s, b = mx.quantize(wf, group_size=GROUP_SIZE, bits=bits)
    x = mx.array(rng.standard_normal((rows_x, 96)).astype(np.float32)).astype(dtype)
    return x, w, s, b, bits
