"""Paged decode attention: one query token per sequence against its KV blocks, split along the
context, the splits merged.

`_CUDA` (with a Metal twin `_METAL` of the same algorithm, in decode_attention_metal.py),
`decode_attention` (checks, picks the split count, launches) and `decode_attention_ref` (gather the
slots, masked SDPA). A 128-thread block takes one (split, kv head, sequence) and walks its split's
KV blocks one at a time (one block-table read a tile). Scores: warp w takes the query heads w, w +
4, ... of the GQA group, a lane a token, the K row read as 16-byte vectors; the online softmax
(running max and sum in float32) leaves the tile's probabilities in shared memory. P V: the 128
threads read 128 / (D / 8) V rows at once as 16-byte vectors (coalesced) and each keeps float32 sums
for its 8 dimensions of every head; the row groups are added in shared memory at the end. So K and V
are read from memory once per kv head, not once per query head. With one split the block writes the
normalized output; with several it writes float32 partials (o, max, sum) that `_CUDA_MERGE`
combines.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kipp_mlx.kernels.decode_attention_metal import _METAL, _METAL_MERGE

THREADS = 128  # 4 warps / simdgroups a block
TARGET_BLOCKS = 264  # two blocks an SM on a 132-SM GPU: splits stop where B * Hkv reaches this
TILES_PER_SPLIT = 8  # long contexts: a split walks at most this many KV blocks
MAX_SPLITS = 128

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

_CUDA = """
    constexpr int G = HQ / HKV;
    constexpr int NW = 4;
    constexpr int GW = (G + NW - 1) / NW;  // heads a warp owns in the score phase
    constexpr int VEC = 16 / sizeof(T);  // elements in a 16-byte load
    constexpr int NDV = D / VEC;  // 16-byte vectors a row
    constexpr int RSUB = 128 / NDV;  // V rows the block reads at once in the PV phase
    const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    const int s = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int S = gridDim.x;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int rsub = tid / NDV, dv = tid % NDV;
    const int max_blocks = block_tables_shape[1];
    const int ctx = context_lens[b];
    const int ntiles = (ctx + BLOCK_SIZE - 1) / BLOCK_SIZE;
    const int per = (ntiles + S - 1) / S;
    const int t0 = s * per;
    const int t1 = min(ntiles, t0 + per);
    const float sc = scale[0];

    __shared__ __align__(16) float qs[G][D];
    __shared__ float ps[G][BLOCK_SIZE];
    __shared__ float corr_s[G];
    __shared__ float ml_s[G][2];
    __shared__ int blk_s;
    __shared__ __align__(16) float red[RSUB][G][D];
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        qs[g][d] = static_cast<float>(q[((size_t)b * HQ + kvh * G + g) * D + d]) * sc;
    }
    float m_run[GW], l_run[GW];
    for (int j = 0; j < GW; j++) { m_run[j] = NEG_INF; l_run[j] = 0.0f; }
    float acc[G][VEC];
    for (int g = 0; g < G; g++) for (int i = 0; i < VEC; i++) acc[g][i] = 0.0f;
    __syncthreads();

    for (int tile = t0; tile < t1; tile++) {
        if (tid == 0) blk_s = block_tables[(size_t)b * max_blocks + tile];
        __syncthreads();
        const size_t base = (size_t)blk_s * BLOCK_SIZE;
        const int n_here = min(BLOCK_SIZE, ctx - tile * BLOCK_SIZE);
        // scores and the online softmax: warp w for heads w, w + NW, ...; a lane a token
        for (int j = 0; j < GW; j++) {
            const int g = warp + j * NW;
            if (g >= G) break;
            float tmax = NEG_INF;
            float sv[(BLOCK_SIZE + 31) / 32];
            for (int c = 0; c * 32 < BLOCK_SIZE; c++) {
                const int t = c * 32 + lane;
                float dot = NEG_INF;
                if (t < n_here) {
                    const T* kr = kv_pool + (((base + t) * 2) * HKV + kvh) * D;
                    dot = 0.0f;
#pragma unroll
                    for (int d0 = 0; d0 < D; d0 += VEC) {
                        const uint4 u = *reinterpret_cast<const uint4*>(kr + d0);
                        const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
                        for (int i = 0; i < VEC; i++)
                            dot += qs[g][d0 + i] * static_cast<float>(e[i]);
                    }
                }
                sv[c] = dot;
                tmax = fmaxf(tmax, dot);
            }
            tmax = kipp_warp_max(tmax);
            const float m_new = fmaxf(m_run[j], tmax);
            const float corr = expf(m_run[j] - m_new);
            float psum = 0.0f;
            for (int c = 0; c * 32 < BLOCK_SIZE; c++) {
                const int t = c * 32 + lane;
                const float p = t < n_here ? expf(sv[c] - m_new) : 0.0f;
                if (t < BLOCK_SIZE) ps[g][t] = p;
                psum += p;
            }
            l_run[j] = l_run[j] * corr + kipp_warp_sum(psum);
            m_run[j] = m_new;
            if (lane == 0) corr_s[g] = corr;
        }
        __syncthreads();
        // P V: thread (rsub, dv) takes rows rsub, rsub + RSUB, ... and dimensions dv * VEC ...
        for (int g = 0; g < G; g++) {
            const float cg_ = corr_s[g];
            for (int i = 0; i < VEC; i++) acc[g][i] *= cg_;
        }
#pragma unroll
        for (int t = rsub; t < BLOCK_SIZE; t += RSUB) {
            if (t < n_here) {
                const T* vr = kv_pool + (((base + t) * 2 + 1) * HKV + kvh) * D + dv * VEC;
                const uint4 u = *reinterpret_cast<const uint4*>(vr);
                const T* e = reinterpret_cast<const T*>(&u);
                for (int g = 0; g < G; g++) {
                    const float p = ps[g][t];
#pragma unroll
                    for (int i = 0; i < VEC; i++) acc[g][i] += p * static_cast<float>(e[i]);
                }
            }
        }
        __syncthreads();
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < VEC; i++) red[rsub][g][dv * VEC + i] = acc[g][i];
    if (lane == 0) {
        for (int j = 0; j < GW; j++) {
            const int g = warp + j * NW;
            if (g < G) { ml_s[g][0] = m_run[j]; ml_s[g][1] = l_run[j]; }
        }
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        float o = 0.0f;
        for (int r = 0; r < RSUB; r++) o += red[r][g][d];
        if (DIRECT) o /= ml_s[g][1];
        const size_t row = (size_t)b * HQ + kvh * G + g;
        out[(row * S + s) * D + d] = static_cast<OT>(o);
        if (d == 0) {
            ml[(row * S + s) * 2] = ml_s[g][0];
            ml[(row * S + s) * 2 + 1] = ml_s[g][1];
        }
    }
"""

# o_part [R, S, D] float32, ml [R, S, 2] float32 -> out [R, D] in T; one block of 128 threads a row
_CUDA_MERGE = """
    const int r = blockIdx.x;
    const int S = o_part_shape[1];
    const int D = o_part_shape[2];
    const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    float m = NEG_INF;
    for (int s = 0; s < S; s++) m = fmaxf(m, ml[((size_t)r * S + s) * 2]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (int s = 0; s < S; s++) {
            const float ms = ml[((size_t)r * S + s) * 2];
            const float w = ms == NEG_INF ? 0.0f : expf(ms - m);
            den += w * ml[((size_t)r * S + s) * 2 + 1];
            num += w * o_part[((size_t)r * S + s) * D + d];
        }
        out[(size_t)r * D + d] = static_cast<T>(num / den);
    }
"""

_INPUTS = ["q", "kv_pool", "block_tables", "context_lens", "scale"]
_built: dict[tuple[str, str], object] = {}
_scales: dict[float, mx.array] = {}  # one device scalar a scale, not one upload a call


def _kernel(kind: str, which: str):
    """The compiled kernel object (`which`: "attention" or "merge") for `kind`."""
    key = (kind, which)
    if key not in _built:
        make = mx.fast.metal_kernel if kind == "metal" else mx.fast.cuda_kernel
        metal = kind == "metal"
        if which == "merge":
            src = _METAL_MERGE if metal else _CUDA_MERGE
            _built[key] = make("kipp_attn_merge", ["o_part", "ml"], ["out"], src)
        else:
            src = _METAL if metal else _CUDA
            kw = {} if metal else {"header": _CUDA_HEADER}
            _built[key] = make("kipp_decode_attention", _INPUTS, ["out", "ml"], src, **kw)
    return _built[key]


def num_splits(batch: int, num_kv_heads: int, max_context: int, block_size: int) -> int:
    """Splits of each sequence's context: enough (split, kv head, sequence) blocks to fill the GPU
    (TARGET_BLOCKS), and more for long contexts (at most TILES_PER_SPLIT KV blocks a split), but
    never more splits than the longest context has KV blocks, nor MAX_SPLITS."""
    tiles = -(-max_context // block_size)
    fill = -(-TARGET_BLOCKS // (batch * num_kv_heads))
    long = -(-tiles // TILES_PER_SPLIT)
    return int(max(1, min(max(fill, long), tiles, MAX_SPLITS)))


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
) -> mx.array:
    """q [B, Hq, D]; kv_pool [slots, 2, Hkv, D]; block_tables [B, max_blocks] int32; context_lens
    [B] (each >= 1; `max_context` their max, known to the host). Returns [B, Hq, D] in q's dtype."""
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
        or 128 % (D // vec)
        or HQ // HKV > 8
    ):
        raise ValueError(
            f"decode_attention needs a pool [slots, 2, Hkv, D] of q's dtype, int32 tables and "
            f"lengths, Hq a multiple of Hkv (at most 8 times), and 128 a multiple of D / (16 / "
            f"itemsize); got q {q.shape} {q.dtype}, pool {kv_pool.shape} {kv_pool.dtype}"
        )
    if max_context is None:
        max_context = block_tables.shape[1] * block_size
    S = splits or num_splits(B, HKV, max_context, block_size)
    out_dtype = q.dtype if S == 1 else mx.float32
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    o_part, ml = _kernel(kind, "attention")(
        inputs=[q, kv_pool, block_tables, context_lens, _scales[scale]],
        template=[
            ("T", q.dtype),
            ("D", D),
            ("HQ", HQ),
            ("HKV", HKV),
            ("BLOCK_SIZE", block_size),
            ("DIRECT", S == 1),
            ("OT", out_dtype),
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
