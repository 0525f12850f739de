"""Qwen3's per-head q/k RMSNorm and RoPE on the fused qkv projection, with K and V laid out for
the paged cache, in one launch.

`_CUDA` (with a Metal twin `_METAL`), `qk_norm_rope` (checks and launches) and `qk_norm_rope_ref`
(the same in MLX ops). A warp takes one head of one token (q heads, then k heads, then v heads);
lane l holds elements l, l + 32, ... of the head, so RoPE's half-split partner (e +- D / 2) is in
the same lane when D / 32 is even and one shuffle away when it is 1. The norm rounds as
transformers' Qwen3RMSNorm does (float32 statistics, the normed row cast to the model dtype, then
times the weight); RoPE reads cos / sin from a float32 table (rope_table) and rounds once.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kipp_core.rope import cos_sin

HEADS_PER_BLOCK = 4

# qkv [T, (HQ + 2 HKV) * D]; q_weight, k_weight [D]; positions [T] int32;
# cos_sin [P, D] float32 (cos of the D / 2 frequencies, then their sin); eps [1] float32
# q_out [T, HQ, D]; kv_out [T, 2, HKV, D] (normed + roped K, then V)
# The writing variant also takes pool [slots, 2, HKV, D] and slots [T] int32 and stores each K / V
# head row into pool[slots[t]] as well: in place, through the input's pointer (KV_POOL_ROW sets
# `pw`, that row of the pool, for K and V heads). STORE(i, v) writes element i of the head.
_CUDA = """
    constexpr int PER = D / 32;
    constexpr int NH = HQ + 2 * HKV;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int head = blockIdx.x * 4 + warp;
    const int t = blockIdx.y;
    if (head >= NH) return;
    const T* src = qkv + ((size_t)t * NH + head) * D;
    KV_POOL_ROW
    if (head >= HQ + HKV) {
        T* dst = kv_out + (((size_t)t * 2 + 1) * HKV + (head - HQ - HKV)) * D;
        for (int i = 0; i < PER; i++) STORE(lane + 32 * i, src[lane + 32 * i]);
        return;
    }
    float x[PER];
    float ss = 0.0f;
    for (int i = 0; i < PER; i++) {
        x[i] = static_cast<float>(src[lane + 32 * i]);
        ss += x[i] * x[i];
    }
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    const float r = rsqrtf(ss / D + eps[0]);
    const T* wgt = head < HQ ? q_weight : k_weight;
    for (int i = 0; i < PER; i++) {
        const float normed = static_cast<float>(static_cast<T>(x[i] * r));
        x[i] = static_cast<float>(static_cast<T>(normed * static_cast<float>(wgt[lane + 32 * i])));
    }
    const float* cs = cos_sin + (size_t)positions[t] * D;
    T* dst = head < HQ ? q_out + ((size_t)t * HQ + head) * D
                       : kv_out + ((size_t)t * 2 * HKV + (head - HQ)) * D;
    if (PER == 1) {
        const float other = __shfl_xor_sync(0xffffffff, x[0], 16);
        const int j = lane % 16;
        const float c = cs[j], s = cs[D / 2 + j];
        const float y = lane < 16 ? x[0] * c - other * s : x[0] * c + other * s;
        STORE(lane, static_cast<T>(y));
    } else {
        for (int i = 0; i < PER / 2; i++) {
            const int j = lane + 32 * i;
            const float c = cs[j], s = cs[D / 2 + j];
            const float a = x[i], b = x[i + PER / 2];
            STORE(j, static_cast<T>(a * c - b * s));
            STORE(j + D / 2, static_cast<T>(b * c + a * s));
        }
    }
"""

_METAL = """
    constexpr int PER = D / 32;
    constexpr int NH = HQ + 2 * HKV;
    const int tid = thread_position_in_threadgroup.x;
    const int warp = tid / 32, lane = tid % 32;
    const int head = threadgroup_position_in_grid.x * 4 + warp;
    const int t = threadgroup_position_in_grid.y;
    if (head >= NH) return;
    const device T* src = qkv + ((size_t)t * NH + head) * D;
    KV_POOL_ROW
    if (head >= HQ + HKV) {
        device T* dst = kv_out + (((size_t)t * 2 + 1) * HKV + (head - HQ - HKV)) * D;
        for (int i = 0; i < PER; i++) STORE(lane + 32 * i, src[lane + 32 * i]);
        return;
    }
    float x[PER];
    float ss = 0.0f;
    for (int i = 0; i < PER; i++) {
        x[i] = float(src[lane + 32 * i]);
        ss += x[i] * x[i];
    }
    ss = simd_sum(ss);
    const float r = metal::precise::rsqrt(ss / D + eps[0]);
    const device T* wgt = head < HQ ? q_weight : k_weight;
    for (int i = 0; i < PER; i++) {
        const float normed = float(static_cast<T>(x[i] * r));
        x[i] = float(static_cast<T>(normed * float(wgt[lane + 32 * i])));
    }
    const device float* cs = cos_sin + (size_t)positions[t] * D;
    device T* dst = head < HQ ? q_out + ((size_t)t * HQ + head) * D
                              : kv_out + ((size_t)t * 2 * HKV + (head - HQ)) * D;
    if (PER == 1) {
        const float other = simd_shuffle_xor(x[0], 16);
        const int j = lane % 16;
        const float c = cs[j], s = cs[D / 2 + j];
        const float y = lane < 16 ? x[0] * c - other * s : x[0] * c + other * s;
        STORE(lane, static_cast<T>(y));
    } else {
        for (int i = 0; i < PER / 2; i++) {
            const int j = lane + 32 * i;
            const float c = cs[j], s = cs[D / 2 + j];
            const float a = x[i], b = x[i + PER / 2];
            STORE(j, static_cast<T>(a * c - b * s));
            STORE(j + D / 2, static_cast<T>(b * c + a * s));
        }
    }
"""

_INPUTS = ["qkv", "q_weight", "k_weight", "positions", "cos_sin", "eps"]
_WRITE_INPUTS = [*_INPUTS, "pool", "slots"]
_built: dict[tuple[str, bool], object] = {}
_STORE = "#define STORE(i, v) dst[i] = (v)\n"
_STORE_POOL = (
    "#define STORE(i, v) do { const T v_ = (v); dst[i] = v_; if (pw) pw[i] = v_; } while (0)\n"
)
_POOL_ROW = {  # pw: the pool row of a K head (k = 0) or V head (k = 1) of token t, else null
    "cuda": """T* pw = nullptr;
    if (head >= HQ) {
        const int k = (head - HQ) / HKV, h = (head - HQ) % HKV;
        pw = const_cast<T*>(pool) + (((size_t)slots[t] * 2 + k) * HKV + h) * D;
    }""",
    "metal": """device T* pw = nullptr;
    if (head >= HQ) {
        const int k = (head - HQ) / HKV, h = (head - HQ) % HKV;
        pw = (device T*)pool + (((size_t)slots[t] * 2 + k) * HKV + h) * D;
    }""",
}


def source(kind: str, write: bool) -> str:
    """The kernel body for `kind` ("cuda" or "metal"), with the pool stores when `write`."""
    src = _METAL if kind == "metal" else _CUDA
    row = _POOL_ROW[kind] if write else ""
    return (_STORE_POOL if write else _STORE) + src.replace("KV_POOL_ROW", row) + "#undef STORE\n"


_eps: dict[float, mx.array] = {}  # one device scalar an eps, not one upload a call


def rope_table(
    num_positions: int, head_dim: int, theta: float, rope_scaling: dict | None = None
) -> mx.array:
    """[num_positions, head_dim] float32: cos of the head_dim / 2 frequencies at each position,
    then their sin, with YaRN's blend and attention factor where `rope_scaling` asks; computed
    by kipp_core.rope in numpy float32, as the oracle computes them."""
    cos, sin = cos_sin(np.arange(num_positions), head_dim, theta, rope_scaling, np.float32)
    half = head_dim // 2
    return mx.array(np.concatenate([cos[:, :half], sin[:, :half]], axis=-1))


def _kernel(kind: str, write: bool = False):
    if (kind, write) not in _built:
        make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
        name = "kipp_qk_norm_rope_write" if write else "kipp_qk_norm_rope"
        inputs = _WRITE_INPUTS if write else _INPUTS
        _built[kind, write] = make(name, inputs, ["q_out", "kv_out"], source(kind, write))
    return _built[kind, write]


def _check(qkv, q_weight, num_heads, num_kv_heads, head_dim, multiple: int = 2):
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if (
        qkv.ndim != 2
        or qkv.shape[1] != width
        or q_weight.shape != (head_dim,)
        or head_dim % multiple
    ):
        raise ValueError(
            f"qk_norm_rope: qkv {qkv.shape} needs [T, {width}], weights [{head_dim}], "
            f"head_dim a multiple of {multiple}"
        )


def qk_norm_rope(
    qkv: mx.array,
    q_weight: mx.array,
    k_weight: mx.array,
    positions: mx.array,
    cos_sin: mx.array,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kind: str = "cuda",
) -> tuple[mx.array, mx.array]:
    """qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq, D] and kv [T, 2, Hkv, D] (K normed and roped)."""
    return _launch(
        kind, qkv, q_weight, k_weight, positions, cos_sin, eps, num_heads, num_kv_heads, head_dim
    )


def qk_norm_rope_write(*args, kind: str = "cuda") -> tuple[mx.array, mx.array, mx.array]:
    """qk_norm_rope(qkv, ..., head_dim), with K and V also stored into pool[slots] (the last two
    arguments: pool [S, 2, Hkv, D] in qkv's dtype, slots [T] int32) in place: returns (q, kv,
    pool), the pool an array on the same buffer that depends on the launch (mx.depends).

    In place because MLX's scatter copies a pool that is not donatable, and a pool never is when
    the step before it is still running: that step's kernels hold it until they finish (MLX's
    CUDA encoder keeps every input alive so). With the host a step ahead of the GPU, every step
    copied every layer's whole pool (its KV budget), whatever the context. MLX sees no write, so
    the returned pool carries it: evaluating the cache's pools runs the launch even where
    nothing else of the step is read (a prefill chunk that samples no token: with the input
    array returned, such a chunk's forward never ran and its K/V were never written), and a
    later evaluation reads the written pool. Inside one evaluation MLX's CUDA graphs order
    kernels by the buffers they declare, and this write is not declared: a reader of the new
    slots in the same evaluation must take q or kv as an input (the paged decode kernel takes
    q; a prefill reads its own new rows from kv, its prefix was written by earlier steps)."""
    qkv, *_, num_kv_heads, head_dim, pool, slots = args  # qk_norm_rope's arguments, pool, slots
    if pool.shape[1:] != (2, num_kv_heads, head_dim) or pool.dtype != qkv.dtype:
        raise ValueError(
            f"qk_norm_rope_write: pool {pool.shape} {pool.dtype} needs [slots, 2, "
            f"{num_kv_heads}, {head_dim}] in {qkv.dtype}"
        )
    if slots.shape != (qkv.shape[0],) or slots.dtype != mx.int32:
        raise ValueError(f"qk_norm_rope_write: slots {slots.shape} need int32 [{qkv.shape[0]}]")
    q, kv = _launch(kind, *args)
    return q, kv, mx.depends(pool, kv)


def _launch(
    kind,
    qkv,
    q_weight,
    k_weight,
    positions,
    cos_sin,
    eps,
    num_heads,
    num_kv_heads,
    head_dim,
    *pool_slots,
):
    _check(qkv, q_weight, num_heads, num_kv_heads, head_dim, 32)
    if q_weight.dtype != qkv.dtype or k_weight.dtype != qkv.dtype or positions.dtype != mx.int32:
        raise ValueError("qk_norm_rope: the norm weights need qkv's dtype and positions int32")
    if eps not in _eps:
        _eps[eps] = mx.array([eps], dtype=mx.float32)
    T = qkv.shape[0]
    nh = num_heads + 2 * num_kv_heads
    q, kv = _kernel(kind, bool(pool_slots))(
        inputs=[qkv, q_weight, k_weight, positions, cos_sin, _eps[eps], *pool_slots],
        template=[("T", qkv.dtype), ("D", head_dim), ("HQ", num_heads), ("HKV", num_kv_heads)],
        grid=(-(-nh // HEADS_PER_BLOCK) * 32 * HEADS_PER_BLOCK, T, 1),
        threadgroup=(32 * HEADS_PER_BLOCK, 1, 1),
        output_shapes=[(T, num_heads, head_dim), (T, 2, num_kv_heads, head_dim)],
        output_dtypes=[qkv.dtype, qkv.dtype],
    )
    return q, kv


def _norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    xf = x.astype(mx.float32)
    r = mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(x.dtype) * (xf * r).astype(x.dtype)).astype(x.dtype)


def _rope(x: mx.array, cos_sin: mx.array, positions: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    cs = cos_sin[positions][:, None, :]  # [T, 1, D]
    c, s = cs[..., :half], cs[..., half:]
    xf = x.astype(mx.float32)
    a, b = xf[..., :half], xf[..., half:]
    return mx.concatenate([a * c - b * s, b * c + a * s], axis=-1).astype(x.dtype)


def qk_norm_rope_ref(
    qkv, q_weight, k_weight, positions, cos_sin, eps, num_heads, num_kv_heads, head_dim, **_
):
    _check(qkv, q_weight, num_heads, num_kv_heads, head_dim)
    T = qkv.shape[0]
    x = qkv.reshape(T, num_heads + 2 * num_kv_heads, head_dim)
    q = x[:, :num_heads]
    k = x[:, num_heads : num_heads + num_kv_heads]
    v = x[:, num_heads + num_kv_heads :]
    q = _rope(_norm(q, q_weight, eps), cos_sin, positions)
    k = _rope(_norm(k, k_weight, eps), cos_sin, positions)
    return q, mx.stack([k, v], axis=1)


def qk_norm_rope_write_ref(*args, **_):
    """qk_norm_rope_ref, then MLX's scatter into the pool (a new array)."""
    *qk, pool, slots = args
    q, kv = qk_norm_rope_ref(*qk)
    pool[slots] = kv
    return q, kv, pool


def write_probe_inputs(num_heads, num_kv_heads, head_dim, dtype, seed: int = 0):
    """probe_inputs, and a 40-slot pool (fresh each call: the kernel writes it) and 5 slots."""
    rng = np.random.default_rng(seed + 1)
    pool = rng.standard_normal((40, 2, num_kv_heads, head_dim)).astype(np.float32)
    slots = np.array([3, 39, 0, 17, 22], dtype=np.int32)
    return (
        *probe_inputs(num_heads, num_kv_heads, head_dim, dtype, seed),
        mx.array(pool).astype(dtype),
        mx.array(slots),
    )


def probe_inputs(num_heads, num_kv_heads, head_dim, dtype, seed: int = 0):
    """5 tokens at scattered positions of a 300-position table."""
    rng = np.random.default_rng(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = mx.array(rng.standard_normal((5, width)).astype(np.float32)).astype(dtype)
    qw = mx.array(rng.uniform(0.5, 1.5, head_dim).astype(np.float32)).astype(dtype)
    kw = mx.array(rng.uniform(0.5, 1.5, head_dim).astype(np.float32)).astype(dtype)
    pos = mx.array(np.array([0, 1, 17, 130, 299], dtype=np.int32))
    table = rope_table(300, head_dim, 1_000_000.0)
    return qkv, qw, kw, pos, table, 1e-6, num_heads, num_kv_heads, head_dim
