"""Paged decode attention: one query token per sequence against its KV blocks, split along the
context, the splits merged.

`_CUDA` (with a Metal twin `_METAL` of the same algorithm, in decode_attention_metal.py),
`decode_attention` (checks, picks the split count, launches) and `decode_attention_ref` (gather the
slots, masked SDPA). A 128-thread block takes one (split, kv head, sequence); its four warps walk
the split's 32-token tiles on their own (warp w takes tiles w, w + 4, ...), each with its own
online softmax, and are merged once at the end: no block barrier inside the loop. In a tile, lane
i owns token i: it reads that token's K row as 16-byte vectors and scores it for every query head
of the GQA group (q in shared memory), and every V row of the tile is loaded at the tile's start,
a lane 16 bytes of a row (addresses from the owners' slots by shuffle), so a tile costs one round
trip to memory. K and V are read once per kv head. One split writes the normalized output;
several write float32 partials (o, max, sum) that `_CUDA_MERGE` combines.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kipp_mlx.kernels.decode_attention_metal import _METAL, _METAL_MERGE
from kipp_mlx.kernels.decode_attention_mma import _CUDA_MMA, _CUDA_MMA_HEADER

THREADS = 128  # 4 warps / simdgroups a block
# A split takes ~TOKENS_PER_SPLIT tokens (4 tiles a warp), up to ~TARGET_BLOCKS blocks (two an
# SM of an H200): the sweep's best at 2,048 / 32,768 tokens and batch 1 / 4 / 64 (BENCHMARKS.md)
TOKENS_PER_SPLIT = 512
TARGET_BLOCKS = 264
MAX_SPLITS = 128  # the merge's block holds a thread a split

# q: [B, HQ, D]; kv_pool: [slots, 2, HKV, D] (K then V); block_tables: [B, max_blocks] int32;
# context_lens: [B] int32; scale: [1] float32.
# out [B, HQ, S, D] in OT, ml [B, HQ, S, 2] float32 (running max, sum); S = the grid's split
# count. DIRECT (S == 1, OT == T): out is the normalized output; else the float32 partials.
_CUDA_HEADER = """
__device__ __forceinline__ float kipp_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
    return v;
}
__device__ __forceinline__ float kipp_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
    return v;
}
"""

# block (split s, kv head, sequence b) -> this split's tokens [tok0, tok1) and b's block table;
# both CUDA kernels start with it
_CUDA_SPLIT = """
    const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    const int s = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int S = gridDim.x;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int ctx = context_lens[b];
    const int per = ((ctx + S - 1) / S + 31) / 32 * 32;  // a split's tokens: whole tiles
    const int tok0 = s * per;
    const int tok1 = min(ctx, tok0 + per);
    const int* table = block_tables + (size_t)b * block_tables_shape[1];
"""

_CUDA = """
    constexpr int G = HQ / HKV;
    constexpr int NW = 4;  // warps a block
    constexpr int VEC = 16 / sizeof(T);  // elements in a 16-byte load
    constexpr int NDV = D / VEC;  // 16-byte vectors a row (<= 32)
    constexpr int RPL = 32 / NDV;  // V rows the warp reads with one load
    constexpr int NR = 32 / RPL;  // V rows a lane in a tile
    constexpr int GP = (G + 3) / 4 * 4;  // a token's p's, padded to float4s
    const int rsub = lane / NDV, dv = lane % NDV;

    __shared__ __align__(16) float qs[G][D];
    __shared__ __align__(16) float ps[NW][32][GP];
    __shared__ __align__(16) float red[NW][G][D];
    __shared__ float m_w[NW][G], l_w[NW][G];
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        qs[g][d] = static_cast<float>(q[((size_t)b * HQ + kvh * G + g) * D + d]) * scale[0];
    }
    __syncthreads();
    float m[G], l[G] = {}, acc[G][VEC] = {};
#pragma unroll
    for (int g = 0; g < G; g++) m[g] = NEG_INF;

    for (int c = tok0 + warp * 32; c < tok1; c += NW * 32) {  // warp-uniform: no divergence
        const int t = c + lane;
        const bool live = t < tok1;  // lane 0's token always is
        const int slot = live ? table[t / BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE : 0;
        uint4 kr[NDV], vr[NR];
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const T* krow = kv_pool + ((size_t)slot * 2 * HKV + kvh) * D;
        const uint4* kp = reinterpret_cast<const uint4*>(krow);
#pragma unroll
        for (int i = 0; i < NDV; i++) kr[i] = live ? kp[i] : zero;
        // lane (rsub, dv) takes rows rsub, rsub + RPL, ... of the tile, 16 bytes at dv * VEC;
        // rows past the context read zeros (their p is 0, a pool's unwritten slot may hold NaN)
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const int tr = r * RPL + rsub;
            const int sr = __shfl_sync(0xffffffff, slot, tr);
            vr[r] = c + tr < tok1 ? *reinterpret_cast<const uint4*>(
                kv_pool + (((size_t)sr * 2 + 1) * HKV + kvh) * D + dv * VEC) : zero;
        }
        float sc[G] = {};
#pragma unroll
        for (int i = 0; i < NDV; i++) {
            const T* e = reinterpret_cast<const T*>(&kr[i]);
#pragma unroll
            for (int j = 0; j < VEC; j += 4) {
                const float k0 = static_cast<float>(e[j]);
                const float k1 = static_cast<float>(e[j + 1]);
                const float k2 = static_cast<float>(e[j + 2]);
                const float k3 = static_cast<float>(e[j + 3]);
#pragma unroll
                for (int g = 0; g < G; g++) {
                    const float4 qv = *reinterpret_cast<const float4*>(&qs[g][i * VEC + j]);
                    sc[g] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
                }
            }
        }
        // the tile's online softmax, a head at a time over the warp's 32 scores
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float x = live ? sc[g] : NEG_INF;
            const float m_new = fmaxf(m[g], kipp_warp_max(x));  // finite
            const float corr = expf(m[g] - m_new);  // 0 at the first tile
            const float p = expf(x - m_new);
            l[g] = l[g] * corr + kipp_warp_sum(p);
            m[g] = m_new;
#pragma unroll
            for (int i = 0; i < VEC; i++) acc[g][i] *= corr;
            ps[warp][lane][g] = p;
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const int tr = r * RPL + rsub;
            float p[GP];
#pragma unroll
            for (int g4 = 0; g4 < GP; g4 += 4) {
                const float4 p4 = *reinterpret_cast<const float4*>(&ps[warp][tr][g4]);
                p[g4] = p4.x, p[g4 + 1] = p4.y, p[g4 + 2] = p4.z, p[g4 + 3] = p4.w;
            }
            const T* e = reinterpret_cast<const T*>(&vr[r]);
#pragma unroll
            for (int g = 0; g < G; g++)
#pragma unroll
                for (int i = 0; i < VEC; i++) acc[g][i] += p[g] * static_cast<float>(e[i]);
        }
        __syncwarp();  // ps is the next tile's
    }
    // a warp's row groups summed by shuffles; then the warps merged by their maxima
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            float a = acc[g][i];
            for (int o = NDV; o < 32; o <<= 1) a += __shfl_xor_sync(0xffffffff, a, o);
            if (lane < NDV) red[warp][g][dv * VEC + i] = a;
        }
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < G; g++) { m_w[warp][g] = m[g]; l_w[warp][g] = l[g]; }
    }
    __syncthreads();
"""

# the warps' states (m_w, l_w, red: [NW][G]...) merged by their maxima into out and ml
_CUDA_WARP_MERGE = """
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        float mx_ = NEG_INF;
#pragma unroll
        for (int w = 0; w < NW; w++) mx_ = fmaxf(mx_, m_w[w][g]);
        float o = 0.0f, den = 0.0f;
        if (mx_ != NEG_INF) {  // an empty split (a shorter row of a ragged batch) stays 0
#pragma unroll
            for (int w = 0; w < NW; w++) {
                const float f = expf(m_w[w][g] - mx_);  // 0 for a warp without a tile
                o += f * red[w][g][d];
                den += f * l_w[w][g];
            }
        }
        if (DIRECT) o /= den;
        const size_t row = (size_t)b * HQ + kvh * G + g;
        out[(row * S + s) * D + d] = static_cast<OT>(o);
        if (d == 0) {
            ml[(row * S + s) * 2] = mx_;
            ml[(row * S + s) * 2 + 1] = den;
        }
    }
"""

# o_part [R, S, D], ml [R, S, 2] float32 -> out [R, D] in T; a 128-thread block a row (S <= 128)
_CUDA_MERGE = """
    const int r = blockIdx.x;
    const int S = o_part_shape[1];
    const int D = o_part_shape[2];
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    __shared__ float w_s[128];
    __shared__ float red_s[4];
    const float ms = tid < S ? ml[((size_t)r * S + tid) * 2] : NEG_INF;
    const float wm = kipp_warp_max(ms);
    if (lane == 0) red_s[warp] = wm;
    __syncthreads();
    const float m = fmaxf(fmaxf(red_s[0], red_s[1]), fmaxf(red_s[2], red_s[3]));
    const float w = ms == NEG_INF ? 0.0f : expf(ms - m);
    w_s[tid] = w;
    const float lw = kipp_warp_sum(tid < S ? w * ml[((size_t)r * S + tid) * 2 + 1] : 0.0f);
    __syncthreads();
    if (lane == 0) red_s[warp] = lw;
    __syncthreads();
    const float den = red_s[0] + red_s[1] + red_s[2] + red_s[3];
    for (int d = tid; d < D; d += 128) {
        const float* op = o_part + (size_t)r * S * D + d;
        float num = 0.0f;
#pragma unroll 4
        for (int j = 0; j < S; j++) num += w_s[j] * op[(size_t)j * D];
        out[(size_t)r * D + d] = static_cast<T>(num / den);
    }
"""

_INPUTS = ["q", "kv_pool", "block_tables", "context_lens", "scale"]
_SIGNATURES = {  # kernel -> (name, inputs, outputs)
    "attention": ("kipp_decode_attention", _INPUTS, ["out", "ml"]),
    "mma": ("kipp_decode_attention_mma", _INPUTS, ["out", "ml"]),
    "merge": ("kipp_attn_merge", ["o_part", "ml"], ["out"]),
}
_built: dict[tuple[str, str], object] = {}
_scales: dict[float, mx.array] = {}  # one device scalar a scale, not one upload a call


def source(kind: str, which: str) -> tuple[str, str]:
    """(body, header) of kernel `which` (a key of _SIGNATURES) for `kind`."""
    if kind == "metal":
        return (_METAL_MERGE if which == "merge" else _METAL), ""
    if which == "merge":
        return _CUDA_MERGE, _CUDA_HEADER
    if which == "mma":
        return _CUDA_SPLIT + _CUDA_MMA + _CUDA_WARP_MERGE, _CUDA_HEADER + _CUDA_MMA_HEADER
    return _CUDA_SPLIT + _CUDA + _CUDA_WARP_MERGE, _CUDA_HEADER


def _kernel(kind: str, which: str):
    """The compiled kernel object `which` for `kind`."""
    if (kind, which) not in _built:
        src, header = source(kind, which)
        make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
        kw = {"header": header} if header else {}
        _built[kind, which] = make(*_SIGNATURES[which], src, **kw)
    return _built[kind, which]


def num_splits(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Splits of each sequence's context: one for every TOKENS_PER_SPLIT tokens of the longest
    context, no more than fill TARGET_BLOCKS blocks, at most MAX_SPLITS."""
    by_len = -(-max_context // TOKENS_PER_SPLIT)
    by_grid = -(-TARGET_BLOCKS // (batch * num_kv_heads))
    return int(max(1, min(by_len, by_grid, MAX_SPLITS)))


def decode_attention(
    q: mx.array,
    kv_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    block_size: int,
    kind: str = "cuda",
    max_context: int | None = None,
    splits: int | None = None,
    mma: bool | None = None,
) -> mx.array:
    """q [B, Hq, D]; kv_pool [slots, 2, Hkv, D]; block_tables [B, max_blocks] int32; context_lens
    [B] (each >= 1; `max_context` their max, known to the host). Returns [B, Hq, D] in q's dtype.
    `mma`: the tensor-core kernel (decode_attention_mma.py); None takes it where it applies (CUDA,
    a 16-bit cache, D a multiple of 64), False the scalar kernel."""
    B, HQ, D = q.shape
    HKV = kv_pool.shape[2]
    vec = 16 // q.dtype.size
    if (
        kv_pool.ndim != 4
        or kv_pool.shape[1] != 2
        or kv_pool.shape[3] != D
        or HQ % HKV
        or kv_pool.dtype != q.dtype
        or q.dtype not in (mx.bfloat16, mx.float16, mx.float32)
        or block_tables.dtype != mx.int32
        or context_lens.dtype != mx.int32
        or D % vec
        or 32 % (D // vec)
        or HQ // HKV > 8
        or block_size < 1
    ):
        raise ValueError(
            f"decode_attention needs a pool [slots, 2, Hkv, D] of q's dtype, int32 tables and "
            f"lengths, Hq a multiple of Hkv (at most 8 times), and 32 a multiple of D / (16 / "
            f"itemsize); got q {q.shape} {q.dtype}, pool {kv_pool.shape} {kv_pool.dtype}, blocks "
            f"of {block_size}"
        )
    if max_context is None:
        max_context = block_tables.shape[1] * block_size
    S = min(splits or num_splits(B, HKV, max_context), MAX_SPLITS)  # merge: <= 128
    out_dtype = q.dtype if S == 1 else mx.float32
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    fits = kind == "cuda" and q.dtype != mx.float32 and D % 64 == 0
    if mma and not fits:
        raise ValueError("decode_attention: the mma kernel needs CUDA, 16 bits and D % 64 == 0")
    o_part, ml = _kernel(kind, "mma" if fits and mma is not False else "attention")(
        inputs=[q, kv_pool, block_tables, context_lens, _scales[scale]],
        template=[
            ("T", q.dtype),
            ("D", D),
            ("HQ", HQ),
            ("HKV", HKV),
            ("BLOCK_SIZE", block_size),
            ("DIRECT", S == 1),
            ("OT", out_dtype),
            ("BF16", q.dtype == mx.bfloat16),
        ],
        grid=(S * THREADS, HKV, B),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, HQ, S, D), (B, HQ, S, 2)],
        output_dtypes=[out_dtype, mx.float32],
    )
    if S == 1:
        return o_part.reshape(B, HQ, D)
    rows = B * HQ
    return _kernel(kind, "merge")(
        inputs=[o_part.reshape(rows, S, D), ml.reshape(rows, S, 2)],
        template=[("T", q.dtype)],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, D)],
        output_dtypes=[q.dtype],
    )[0].reshape(B, HQ, D)


def sdpa_padded(
    q: mx.array, k: mx.array, v: mx.array, mask: mx.array | None, scale: float
) -> mx.array:
    """q [B, Hq, D]; k, v [B, S, Hkv, D]; mask [B, 1, 1, S] bool (True = attend) or None."""
    o = mx.fast.scaled_dot_product_attention(
        q[:, :, None, :],
        k.transpose(0, 2, 1, 3),
        v.transpose(0, 2, 1, 3),
        scale=scale,
        mask=mask,
    )
    return o[:, :, 0, :]


def decode_attention_ref(
    q, kv_pool, block_tables, context_lens, scale: float, block_size: int, **_
) -> mx.array:
    """Gather every sequence's slots (padded to the table's width), then masked SDPA."""
    B, nb = block_tables.shape
    slots = block_tables[:, :, None] * block_size + mx.arange(block_size, dtype=mx.int32)
    slots = slots.reshape(B, nb * block_size)
    mask = (mx.arange(nb * block_size)[None, :] < context_lens[:, None])[:, None, None, :]
    kv = kv_pool[slots]  # [B, S, 2, Hkv, D]
    return sdpa_padded(q, kv[:, :, 0], kv[:, :, 1], mask, scale)


def probe_inputs(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype,
    seed: int = 0,
    lens: tuple[int, ...] | None = None,
):
    """An awkward decode batch for the ladder: contexts of 1, a block and a bit, and several
    blocks (long enough to split), on scattered blocks of a small pool."""
    rng = np.random.default_rng(seed)
    if lens is None:
        lens = (1, block_size + 3, 9 * block_size - 1)
    lens_np = np.array(lens, dtype=np.int32)
    nb = -(-lens_np // block_size)
    num_blocks = int(nb.sum()) + 3
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(lens_np), int(nb.max())), dtype=np.int32)
    used = 0
    for i, n in enumerate(nb):
        tables[i, :n] = perm[used : used + n]
        used += n
    slots = num_blocks * block_size
    q = rng.standard_normal((len(lens_np), num_heads, head_dim)).astype(np.float32)
    kv = rng.standard_normal((slots, 2, num_kv_heads, head_dim)).astype(np.float32)
    return (
        mx.array(q).astype(dtype),
        mx.array(kv).astype(dtype),
        mx.array(tables, dtype=mx.int32),
        mx.array(lens_np, dtype=mx.int32),
        head_dim**-0.5,
        block_size,
    )
