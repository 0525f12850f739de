"""Paged decode attention: one query token per sequence against its KV blocks, split along the
context, the splits merged.

`_CUDA` (with a Metal twin `_METAL` of the same algorithm, in decode_attention_metal.py),
`decode_attention` (checks, picks the split count, launches) and `decode_attention_ref` (gather the
slots, masked SDPA). A 128-thread block takes one (split, kv head, sequence) and walks its split in
chunks of up to 128 tokens (their block-table entries read at once): scores with a thread a token,
its K row read as 16-byte vectors once for every query head of the GQA group; the chunk's online
softmax (float32), a warp a head; then P V, the 128 threads reading 128 / (D / 8) V rows at once
(coalesced), every row's load issued before the sums. So K and V are read once per kv head, three
barriers a chunk. One split writes the normalized output; several write float32 partials (o, max,
sum) that `_CUDA_MERGE` combines.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kipp_mlx.kernels.decode_attention_metal import _METAL, _METAL_MERGE

THREADS = 128  # 4 warps / simdgroups a block
# A split walks ~TILES_PER_SPLIT KV blocks (its chunks run in sequence, ~3 us each on an H200; a
# split adds fixed and merge cost). 8B heads, batch 1, 1 / 2 / 4 / 8 / 16 splits at 2,048 tokens:
# 72 / 43 / 30 / 27 / 33 us; 32,768 best at 32; batch 64 best at 4 (fa2aa13-h200/mlx/mlx_attn)
TILES_PER_SPLIT = 16
AUTO_SPLITS = 32
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
    constexpr int TPC = 128 / BLOCK_SIZE;  // KV blocks a chunk
    constexpr int CH = TPC * BLOCK_SIZE;  // tokens a chunk: a thread a token in the score phase
    constexpr int NV = (CH + 31) / 32;  // scores a lane in the softmax phase
    constexpr int VEC = 16 / sizeof(T);  // elements in a 16-byte load
    constexpr int NDV = D / VEC;  // 16-byte vectors a row
    constexpr int RSUB = 128 / NDV;  // V rows the block reads at once in the PV phase
    constexpr int NR = (CH + RSUB - 1) / RSUB;  // V rows a thread in a chunk
    const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();
    const int s = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int S = gridDim.x;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int rsub = tid / NDV, dv = tid % NDV;
    const int max_blocks = block_tables_shape[1];
    const int ctx = context_lens[b];
    const int ntiles = (ctx + BLOCK_SIZE - 1) / BLOCK_SIZE;
    const int per = (ntiles + S - 1) / S;
    const int tok0 = s * per * BLOCK_SIZE;
    const int tok1 = min(ctx, (s + 1) * per * BLOCK_SIZE);

    __shared__ __align__(16) float qs[G][D];
    __shared__ float ps[G][CH];
    __shared__ float corr_s[G], m_s[G], l_s[G];
    __shared__ int blk_s[TPC];
    __shared__ __align__(16) float red[NW][G][D];
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        qs[g][d] = static_cast<float>(q[((size_t)b * HQ + kvh * G + g) * D + d]) * scale[0];
    }
    if (tid < G) { m_s[tid] = NEG_INF; l_s[tid] = 0.0f; }
    float acc[G][VEC];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int i = 0; i < VEC; i++) acc[g][i] = 0.0f;

    for (int c0 = tok0; c0 < tok1; c0 += CH) {
        const int n = min(CH, tok1 - c0);
        if (tid < TPC) {
            const int tile = c0 / BLOCK_SIZE + tid;
            blk_s[tid] = tile < ntiles ? block_tables[(size_t)b * max_blocks + tile] : 0;
        }
        __syncthreads();
        // scores: thread t takes token c0 + t, its K row read once for every head of the group
        if (tid < CH) {
            float dot[G];
#pragma unroll
            for (int g = 0; g < G; g++) dot[g] = tid < n ? 0.0f : NEG_INF;
            if (tid < n) {
                const size_t slot = (size_t)blk_s[tid / BLOCK_SIZE] * BLOCK_SIZE + tid % BLOCK_SIZE;
                const uint4* kr =
                    reinterpret_cast<const uint4*>(kv_pool + (slot * 2 * HKV + kvh) * D);
                uint4 kv[NDV];
#pragma unroll
                for (int i = 0; i < NDV; i++) kv[i] = kr[i];
#pragma unroll
                for (int i = 0; i < NDV; i++) {
                    const T* e = reinterpret_cast<const T*>(&kv[i]);
#pragma unroll
                    for (int j = 0; j < VEC; j += 4) {
                        const float k0 = static_cast<float>(e[j]);
                        const float k1 = static_cast<float>(e[j + 1]);
                        const float k2 = static_cast<float>(e[j + 2]);
                        const float k3 = static_cast<float>(e[j + 3]);
#pragma unroll
                        for (int g = 0; g < G; g++) {
                            const float4 qv = *reinterpret_cast<const float4*>(&qs[g][i * VEC + j]);
                            dot[g] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
                        }
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < G; g++) ps[g][tid] = dot[g];
        }
        __syncthreads();
        // the chunk's online softmax: warp w for heads w, w + NW, ...
        for (int g = warp; g < G; g += NW) {
            float v[NV];
            float cmax = NEG_INF;
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const int t = i * 32 + lane;
                v[i] = t < CH ? ps[g][t] : NEG_INF;
                cmax = fmaxf(cmax, v[i]);
            }
            cmax = kipp_warp_max(cmax);
            const float m_old = m_s[g];
            const float m_new = fmaxf(m_old, cmax);  // finite: the chunk holds a token
            float psum = 0.0f;
#pragma unroll
            for (int i = 0; i < NV; i++) {
                const int t = i * 32 + lane;
                const float p = expf(v[i] - m_new);
                if (t < CH) ps[g][t] = p;
                psum += p;
            }
            psum = kipp_warp_sum(psum);
            if (lane == 0) {
                const float corr = expf(m_old - m_new);
                corr_s[g] = corr;
                l_s[g] = l_s[g] * corr + psum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();
        // P V: thread (rsub, dv) takes rows rsub, rsub + RSUB, ... and dimensions dv * VEC ...;
        // every row's load issued before the sums (rows past the context read zeros, p is 0)
#pragma unroll
        for (int g = 0; g < G; g++) {
            const float cg = corr_s[g];
#pragma unroll
            for (int i = 0; i < VEC; i++) acc[g][i] *= cg;
        }
        uint4 vv[NR];
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const int t = r * RSUB + rsub;
            vv[r] = make_uint4(0, 0, 0, 0);
            if (t < n) {
                const size_t slot = (size_t)blk_s[t / BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE;
                vv[r] = *reinterpret_cast<const uint4*>(
                    kv_pool + ((slot * 2 + 1) * HKV + kvh) * D + dv * VEC);
            }
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            const int t = r * RSUB + rsub;
            if (t < n) {
                const T* e = reinterpret_cast<const T*>(&vv[r]);
#pragma unroll
                for (int g = 0; g < G; g++) {
                    const float p = ps[g][t];
#pragma unroll
                    for (int i = 0; i < VEC; i++) acc[g][i] += p * static_cast<float>(e[i]);
                }
            }
        }
        __syncthreads();
    }
    // the row groups' sums: within a warp by shuffles, then the warps' in shared memory
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int i = 0; i < VEC; i++) {
            float a = acc[g][i];
            for (int o = NDV; o < 32; o <<= 1) a += __shfl_xor_sync(0xffffffff, a, o);
            if (lane < NDV) red[warp][g][dv * VEC + i] = a;
        }
    __syncthreads();
    for (int i = tid; i < G * D; i += 128) {
        const int g = i / D, d = i % D;
        float o = red[0][g][d] + red[1][g][d] + red[2][g][d] + red[3][g][d];
        if (DIRECT) o /= l_s[g];
        const size_t row = (size_t)b * HQ + kvh * G + g;
        out[(row * S + s) * D + d] = static_cast<OT>(o);
        if (d == 0) {
            ml[(row * S + s) * 2] = m_s[g];
            ml[(row * S + s) * 2 + 1] = l_s[g];
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
            kw = {} if metal else {"header": _CUDA_HEADER}
            _built[key] = make("kipp_attn_merge", ["o_part", "ml"], ["out"], src, **kw)
        else:
            src = _METAL if metal else _CUDA
            kw = {} if metal else {"header": _CUDA_HEADER}
            _built[key] = make("kipp_decode_attention", _INPUTS, ["out", "ml"], src, **kw)
    return _built[key]


def num_splits(batch: int, num_kv_heads: int, max_context: int, block_size: int) -> int:
    """Splits of each sequence's context: one for every TILES_PER_SPLIT KV blocks of the longest
    context, at most AUTO_SPLITS. The batch does not enter: at batch 64 the same count won."""
    tiles = -(-max_context // block_size)
    return int(max(1, min(-(-tiles // TILES_PER_SPLIT), AUTO_SPLITS)))


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
        or D // vec > 32
        or HQ // HKV > 8
        or not 1 <= block_size <= 128
    ):
        raise ValueError(
            f"decode_attention needs a pool [slots, 2, Hkv, D] of q's dtype, int32 tables and "
            f"lengths, Hq a multiple of Hkv (at most 8 times), and 128 a multiple of D / (16 / "
            f"itemsize) and D / (16 / itemsize) at most 32, KV blocks of at most 128 slots; got q "
            f"{q.shape} {q.dtype}, pool {kv_pool.shape} {kv_pool.dtype}, blocks of {block_size}"
        )
    if max_context is None:
        max_context = block_tables.shape[1] * block_size
    S = min(splits or num_splits(B, HKV, max_context, block_size), MAX_SPLITS)  # merge: <= 128
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
