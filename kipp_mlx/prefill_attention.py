"""Attention of one sequence's query rows over its contiguous context, bounded in memory.

`prefill_attention` is mx.fast.scaled_dot_product_attention (the reference) where MLX fuses it:
on Metal, and on MLX's CUDA build in bfloat16 or float16 with head_dim at most 128 (cuDNN's fused
attention, with the causal mask aligned lower-right). There the whole prompt chunk is one call.
Elsewhere (float32 on CUDA, the CPU) SDPA holds the whole [Hq, L, keys] score matrix, growing with
the context: 512 rows of 16 heads take 532 MiB at 32,768 keys and 2.1 GiB at 131,072 on the CPU
(benchmarks/2026-12-02-3af5938-cpu). There the rows come in chunks of QUERY_CHUNK and, past
SDPA_SCORES, `tiled_attention` walks the keys SCORE_TILE / (Hq L) at a time with an online
softmax (running max and sum in float32, as flash attention does). Its peak is about ten tiles'
float32 scores whatever the context (MLX keeps a few tiles' temporaries alive at once: 2.4 GiB
at 32,768 keys, 2.8 GiB at 131,072), so it takes over where SDPA would hold more than that: past
65,536 keys for 32 heads, 131,072 for 16. Each tile's keys wait for the previous tile's state
(mx.depends), else MLX may compute every tile's scores up front. Matmuls run in the inputs'
dtype, as MLX's own SDPA fallback runs them; the softmax and the accumulation are float32.
"""

from __future__ import annotations

import mlx.core as mx

QUERY_CHUNK = 512  # query rows a call where SDPA is not fused
SDPA_SCORES = 1 << 30  # past this many scores in one call (2 GiB in bf16), tiles hold fewer
SCORE_TILE = 1 << 26  # scores a tile: 256 MiB in float32


def fused_sdpa(dtype, head_dim: int) -> bool:
    """Whether MLX's SDPA over many query rows is one fused kernel here (no score matrix)."""
    if mx.default_device() != mx.gpu:
        return False
    if mx.metal.is_available():
        return True
    return dtype in (mx.bfloat16, mx.float16) and head_dim <= 128 and head_dim % 8 == 0


def prefill_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """q [1, Hq, L, D]; k, v [1, Hkv, N, D] with N >= L, causal with lower-right alignment (row i
    sees keys up to N - L + i). Returns [1, Hq, L, D] in q's dtype."""
    L, N = q.shape[2], k.shape[2]
    if q.shape[1] * L * N <= SDPA_SCORES or fused_sdpa(q.dtype, q.shape[3]):
        mask = "causal" if L > 1 else None
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    return tiled_attention(q, k, v, scale, max(1, SCORE_TILE // (q.shape[1] * L)))


def _tile_step(qg, k, v, m, den, acc, seen):
    """One key tile of the online softmax: qg [Hkv, G L, D] (pre-scaled), k and v [Hkv, t, D],
    seen [1, 1, L, t] bool or None."""
    s = (qg @ k.swapaxes(1, 2)).astype(mx.float32)  # [Hkv, G L, t]
    if seen is not None:
        hkv, gl, t = s.shape
        s = mx.where(seen, s.reshape(hkv, -1, seen.shape[2], t), -float("inf")).reshape(hkv, gl, t)
    m_new = mx.maximum(m, s.max(axis=-1))  # finite: every row sees key 0, in the first tile
    alpha = mx.exp(m - m_new)
    p = mx.exp(s - m_new[..., None])
    den = den * alpha + p.sum(axis=-1)
    acc = acc * alpha[..., None] + (p.astype(v.dtype) @ v).astype(mx.float32)
    return m_new, den, acc


def tiled_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, tile: int) -> mx.array:
    """prefill_attention's result, `tile` keys at a time. The query heads of a GQA group share
    their kv head's tile: q is viewed as [Hkv, G L, D], row g L + i being head g's row i."""
    _, HQ, L, D = q.shape
    HKV, N = k.shape[1], k.shape[2]
    qg = (q * scale).reshape(HKV, HQ // HKV * L, D)
    k, v = k[0], v[0]  # [Hkv, N, D]
    limit = (N - L + mx.arange(L, dtype=mx.int32))[:, None]  # [L, 1]: the last key row i sees
    m = mx.full((HKV, qg.shape[1]), -float("inf"), dtype=mx.float32)
    den = mx.zeros((HKV, qg.shape[1]), dtype=mx.float32)
    acc = mx.zeros(qg.shape, dtype=mx.float32)
    for a in range(0, N, tile):
        b = min(N, a + tile)
        # only tiles past the first row's limit need the mask
        seen = (
            (mx.arange(a, b, dtype=mx.int32)[None, :] <= limit)[None, None]
            if b - 1 > N - L
            else None
        )
        # the tile's keys wait for the previous tile's state, so that one tile's scores are
        # live at a time (else the graph may compute every tile's matmul up front)
        kt, vt = mx.depends([k[:, a:b], v[:, a:b]], [m, den, acc])
        m, den, acc = _tile_step(qg, kt, vt, m, den, acc, seen)
    return (acc / den[..., None]).astype(q.dtype).reshape(1, HQ, L, D)
