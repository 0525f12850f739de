"""Paged decode attention: one query token per sequence against its KV blocks.

`_paged_attention_kernel` (Metal, with a CUDA twin of the same algorithm), `paged_attention`
(checks and launches) and `paged_attention_ref` (gather the slots, masked SDPA). One 32-thread
group per (query head, sequence); each lane holds head_dim / 32 values of q and of the output and
runs an online softmax over the context, accumulating in float32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# q: [B, HQ, D]; k_pool, v_pool: [slots, HKV, D]; block_tables: [B, max_blocks] int32;
# context_lens: [B] int32; scale: [1] float32; out: [B, HQ, D].
_METAL = """
    const uint h = threadgroup_position_in_grid.x;
    const uint b = threadgroup_position_in_grid.y;
    const uint lane = thread_position_in_threadgroup.x;
    constexpr int PER = D / 32;
    const int max_blocks = block_tables_shape[1];
    const int ctx = context_lens[b];
    const uint kvh = h / (HQ / HKV);
    const float sc = scale[0];
    const size_t q_off = ((size_t)b * HQ + h) * D;
    float qv[PER];
    float acc[PER];
    for (int i = 0; i < PER; i++) {
        qv[i] = float(q[q_off + lane + 32 * i]);
        acc[i] = 0.0f;
    }
    float m = -INFINITY;
    float l = 0.0f;
    for (int t = 0; t < ctx; t++) {
        const size_t slot = (size_t)block_tables[b * max_blocks + t / BLOCK_SIZE] * BLOCK_SIZE
                            + t % BLOCK_SIZE;
        const size_t kv_off = (slot * HKV + kvh) * D;
        float dot = 0.0f;
        for (int i = 0; i < PER; i++) {
            dot += qv[i] * float(k_pool[kv_off + lane + 32 * i]);
        }
        dot = simd_sum(dot) * sc;
        const float m_new = max(m, dot);
        const float corr = metal::exp(m - m_new);
        const float p = metal::exp(dot - m_new);
        l = l * corr + p;
        for (int i = 0; i < PER; i++) {
            acc[i] = acc[i] * corr + p * float(v_pool[kv_off + lane + 32 * i]);
        }
        m = m_new;
    }
    for (int i = 0; i < PER; i++) {
        out[q_off + lane + 32 * i] = static_cast<T>(acc[i] / l);
    }
"""

_CUDA = """
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int lane = threadIdx.x;
    constexpr int PER = D / 32;
    const int max_blocks = block_tables_shape[1];
    const int ctx = context_lens[b];
    const int kvh = h / (HQ / HKV);
    const float sc = scale[0];
    const size_t q_off = ((size_t)b * HQ + h) * D;
    float qv[PER];
    float acc[PER];
    for (int i = 0; i < PER; i++) {
        qv[i] = static_cast<float>(q[q_off + lane + 32 * i]);
        acc[i] = 0.0f;
    }
    float m = -inf;
    float l = 0.0f;
    for (int t = 0; t < ctx; t++) {
        const size_t slot = (size_t)block_tables[b * max_blocks + t / BLOCK_SIZE] * BLOCK_SIZE
                            + t % BLOCK_SIZE;
        const size_t kv_off = (slot * HKV + kvh) * D;
        float dot = 0.0f;
        for (int i = 0; i < PER; i++) {
            dot += qv[i] * static_cast<float>(k_pool[kv_off + lane + 32 * i]);
        }
        for (int o = 16; o > 0; o >>= 1) {
            dot += __shfl_xor_sync(0xffffffff, dot, o);
        }
        dot *= sc;
        const float m_new = fmaxf(m, dot);
        const float corr = expf(m - m_new);
        const float p = expf(dot - m_new);
        l = l * corr + p;
        for (int i = 0; i < PER; i++) {
            acc[i] = acc[i] * corr + p * static_cast<float>(v_pool[kv_off + lane + 32 * i]);
        }
        m = m_new;
    }
    for (int i = 0; i < PER; i++) {
        out[q_off + lane + 32 * i] = static_cast<T>(acc[i] / l);
    }
"""

_INPUTS = ["q", "k_pool", "v_pool", "block_tables", "context_lens", "scale"]
_built: dict[str, object] = {}


def _paged_attention_kernel(kind: str):
    """The compiled kernel object for `kind` ("metal" or "cuda"), built once."""
    if kind not in _built:
        if kind == "metal":
            _built[kind] = mx.fast.metal_kernel("kipp_paged_attention", _INPUTS, ["out"], _METAL)
        else:
            _built[kind] = mx.fast.cuda_kernel("kipp_paged_attention", _INPUTS, ["out"], _CUDA)
    return _built[kind]


def paged_attention(
    q,
    k_pool,
    v_pool,
    block_tables,
    context_lens,
    scale: float,
    block_size: int,
    kind: str = "metal",
) -> mx.array:
    """q [B, Hq, D]; pools [slots, Hkv, D]; block_tables [B, max_blocks]; context_lens [B] (>= 1).
    Returns [B, Hq, D] in q's dtype."""
    B, HQ, D = q.shape
    HKV = k_pool.shape[1]
    if D % 32 or HQ % HKV or k_pool.dtype != q.dtype or v_pool.shape != k_pool.shape:
        raise ValueError(
            f"paged_attention needs head_dim % 32 == 0, Hq % Hkv == 0 and matching dtypes; got "
            f"q {q.shape} {q.dtype}, pools {k_pool.shape} {k_pool.dtype}"
        )
    kernel = _paged_attention_kernel(kind)
    return kernel(
        inputs=[
            q,
            k_pool,
            v_pool,
            block_tables.astype(mx.int32),
            context_lens.astype(mx.int32),
            mx.array([scale], dtype=mx.float32),
        ],
        template=[("T", q.dtype), ("D", D), ("HQ", HQ), ("HKV", HKV), ("BLOCK_SIZE", block_size)],
        grid=(HQ * 32, B, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )[0]


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


def paged_attention_ref(
    q, k_pool, v_pool, block_tables, context_lens, scale: float, block_size: int
) -> mx.array:
    B, nb = block_tables.shape
    slots = block_tables[:, :, None] * block_size + mx.arange(block_size, dtype=mx.int32)
    slots = slots.reshape(B, nb * block_size)
    mask = (mx.arange(nb * block_size)[None, :] < context_lens[:, None])[:, None, None, :]
    return sdpa_padded(q, k_pool[slots], v_pool[slots], mask, scale)


def probe_inputs(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype, seed: int = 0
):
    """Awkward decode batch for the ladder: contexts of 1, a block and a bit, and several blocks,
    on scattered blocks of a small pool."""
    rng = np.random.default_rng(seed)
    lens = np.array([1, block_size + 3, 5 * block_size - 1], dtype=np.int32)
    nb = -(-lens // block_size)
    num_blocks = int(nb.sum()) + 3
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(lens), int(nb.max())), dtype=np.int32)
    used = 0
    for i, n in enumerate(nb):
        tables[i, :n] = perm[used : used + n]
        used += n
    slots = num_blocks * block_size

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q = normal(len(lens), num_heads, head_dim)
    k, v = normal(slots, num_kv_heads, head_dim), normal(slots, num_kv_heads, head_dim)
    return q, k, v, mx.array(tables), mx.array(lens), head_dim**-0.5, block_size
