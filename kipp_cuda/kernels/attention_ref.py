"""The torch reference of paged attention that the decode and prefill references share, in memory
bounded at any context: queries and cached positions are taken a chunk at a time, and the chunks'
softmax partials merged by their running max (the flash recurrence, fp32 throughout). A context of
at most KV_CHUNK positions is one chunk: a plain fp32 softmax.

At an 8B shape (32 q heads, 8 kv heads, 128 dims) one step holds a [KV_CHUNK, 8, 128] K and V in
fp32 (16 MiB each) and at most SCORE_ELEMS fp32 scores (64 MiB), whatever the context; gathering
the whole context once, repeated over the G heads, took 2 GiB a K at 131,072 positions.
"""

from __future__ import annotations

import torch

from kipp_cuda.kernels.kv_write import dequantize_q8_0_ref

KV_CHUNK = 4096  # cached positions a step reads
SCORE_ELEMS = 1 << 24  # fp32 scores (and as many probabilities) a step holds


def gather_kv_ref(cache, scale, block_table, n: int, start: int = 0) -> torch.Tensor:
    """Positions start..n-1 of one sequence, [n - start, num_kv_heads, head_dim] float32."""
    block_size = cache.shape[1]
    pos = torch.arange(start, n, device=cache.device)
    blocks = block_table[pos // block_size].long()
    x = cache[blocks, pos % block_size]
    if scale is not None:
        return dequantize_q8_0_ref(x, scale[blocks, pos % block_size])
    return x.float()


def attend_ref(q, q_pos, k_cache, v_cache, k_scale, v_scale, block_table, scale: float):
    """Causal attention of q [L, Hq, D] at positions q_pos (int64 [L]) over one sequence's cached
    positions 0..max(q_pos): fp32 [L, Hq, D]. Query head h reads kv head h // (Hq / Hkv)."""
    L, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    G = num_q_heads // num_kv_heads
    out = torch.empty(L, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    n = int(q_pos.max()) + 1 if L else 0
    rows = max(1, SCORE_ELEMS // (num_q_heads * min(max(n, 1), KV_CHUNK)))
    for i in range(0, L, rows):
        qi = q[i : i + rows].float().reshape(-1, num_kv_heads, G, head_dim)
        pos = q_pos[i : i + rows]
        hi = int(pos.max()) + 1
        m = torch.full(qi.shape[:3], float("-inf"), device=q.device)  # running max
        total = torch.zeros(qi.shape[:3], device=q.device)  # running sum of exp(s - m)
        acc = torch.zeros(qi.shape, device=q.device)
        for j in range(0, hi, KV_CHUNK):  # chunk 0 holds position 0, seen by every query
            c = min(hi, j + KV_CHUNK)
            k = gather_kv_ref(k_cache, k_scale, block_table, c, j)
            v = gather_kv_ref(v_cache, v_scale, block_table, c, j)
            s = torch.einsum("lkgd,nkd->lkgn", qi, k) * scale
            causal = torch.arange(j, c, device=q.device)[None, :] <= pos[:, None]  # [l, n]
            s = s.masked_fill(~causal[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(-1))
            p = torch.exp(s - m_new[..., None])
            keep = torch.exp(m - m_new)  # 0 before the first chunk (m = -inf)
            total = total * keep + p.sum(-1)
            acc = acc * keep[..., None] + torch.einsum("lkgn,nkd->lkgd", p, v)
            m = m_new
        out[i : i + rows] = (acc / total[..., None]).reshape(-1, num_q_heads, head_dim)
    return out
