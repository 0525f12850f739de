"""Attention over the paged KV cache, and the step's metadata that drives it.

A step is one flat batch of T new tokens. Each sequence's queries attend causally over its whole
context (cached tokens plus its own new ones). Two paths:
- decode (every sequence runs one token): one batched attention over the block tables, through the
  paged decode kernel when the ladder chose it, else its reference (gather + masked SDPA);
- otherwise (prefill chunks, verification rows): per sequence, gather the context's slots and run
  mx.fast.scaled_dot_product_attention with a lower-right causal mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kipp_mlx.kernels.paged_attention import sdpa_padded
from kipp_mlx.kv_cache import PagedKVCache

QUERY_CHUNK = 512  # query rows per attention call in a prefill
MAX_PADDED_SLOTS = 1 << 16  # the batched decode reference gathers at most B * S slots


@dataclass
class SeqSpan:
    q_start: int  # first row of this sequence in the flat batch
    q_len: int
    context_len: int  # tokens attended: cached + new


@dataclass
class AttentionMetadata:
    positions: mx.array  # [T] int32 absolute positions of the new tokens
    slot_mapping: mx.array  # [T] int32 KV slot of each new token
    spans: list[SeqSpan]
    context_slots: mx.array  # [sum context_len] int32: each sequence's slots, concatenated
    is_decode: bool  # one batched decode attention (the kernel, or a padded gather)
    # decode only: the kernel's view ...
    block_tables: mx.array | None = None  # [B, max_blocks] int32
    context_lens: mx.array | None = None  # [B] int32
    # ... and the reference's: slots padded to the longest context, and the padding mask
    decode_slots: mx.array | None = None  # [B, S] int32
    decode_mask: mx.array | None = None  # [B, 1, 1, S] bool, None when nothing is padded
    paged_attention: Callable | None = None  # the decode kernel, when the ladder chose one

    @classmethod
    def build(cls, seqs, block_size: int, paged_attention: Callable | None = None):
        """From the step's SeqInputs (token_ids, start_pos, block_table)."""
        positions, slot_mapping, spans, ctx_slots = [], [], [], []
        row = 0
        for s in seqs:
            n, start = len(s.token_ids), s.start_pos
            ctx = start + n
            nb = -(-ctx // block_size)
            if len(s.block_table) < nb:
                raise ValueError(
                    f"seq {s.seq_id}: block_table has {len(s.block_table)} blocks, "
                    f"{ctx} tokens need {nb}"
                )
            table = np.asarray(s.block_table[:nb], dtype=np.int64)
            slots = (table[:, None] * block_size + np.arange(block_size)).reshape(-1)[:ctx]
            positions.append(np.arange(start, ctx))
            slot_mapping.append(slots[start:])
            ctx_slots.append(slots)
            spans.append(SeqSpan(row, n, ctx))
            row += n
        is_decode = all(sp.q_len == 1 for sp in spans)
        if is_decode and paged_attention is None:
            # Padding every context to the longest wastes memory on ragged batches: past the
            # limit, decode rows take the per-sequence path.
            is_decode = len(spans) * max(sp.context_len for sp in spans) <= MAX_PADDED_SLOTS
        meta = cls(
            positions=mx.array(np.concatenate(positions).astype(np.int32)),
            slot_mapping=mx.array(np.concatenate(slot_mapping).astype(np.int32)),
            spans=spans,
            context_slots=mx.array(np.concatenate(ctx_slots).astype(np.int32)),
            is_decode=is_decode,
        )
        if is_decode:
            meta._add_decode(seqs, ctx_slots, block_size, paged_attention)
        return meta

    def _add_decode(self, seqs, ctx_slots, block_size, paged_attention) -> None:
        lens = np.array([len(s) for s in ctx_slots], dtype=np.int32)
        S = int(lens.max())
        padded = np.zeros((len(ctx_slots), S), dtype=np.int32)
        for i, s in enumerate(ctx_slots):
            padded[i, : len(s)] = s
        self.decode_slots = mx.array(padded)
        if (lens != S).any():
            self.decode_mask = mx.array(np.arange(S)[None, :] < lens[:, None])[:, None, None, :]
        self.context_lens = mx.array(lens)
        if paged_attention is not None:
            nb = -(-lens // block_size)
            tables = np.zeros((len(seqs), int(nb.max())), dtype=np.int32)
            for i, s in enumerate(seqs):
                tables[i, : nb[i]] = s.block_table[: nb[i]]
            self.block_tables = mx.array(tables)
            self.paged_attention = paged_attention


def attend(
    q: mx.array, kv: PagedKVCache, layer: int, meta: AttentionMetadata, scale: float
) -> mx.array:
    """q: [T, Hq, D] (post-RoPE); the new tokens' K/V are already in `kv`. Returns [T, Hq, D]."""
    if meta.is_decode:
        if meta.paged_attention is not None and not kv.kv_quant:
            k_pool, v_pool = kv.pools(layer)
            return meta.paged_attention(
                q, k_pool, v_pool, meta.block_tables, meta.context_lens, scale, kv.block_size
            )
        k, v = kv.read(layer, meta.decode_slots)  # [B, S, Hkv, D]
        return sdpa_padded(q, k, v, meta.decode_mask, scale)
    outs = []
    c0 = 0
    for sp in meta.spans:
        k, v = kv.read(layer, meta.context_slots[c0 : c0 + sp.context_len])  # [ctx, Hkv, D]
        c0 += sp.context_len
        k, v = k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]  # [1, Hkv, ctx, D]
        # Long prefills run in query chunks, so the scores stay [Hq, QUERY_CHUNK, ctx]; a chunk
        # ending at row b sees keys up to ctx - L + b (lower-right causal alignment).
        for a in range(0, sp.q_len, QUERY_CHUNK):
            b = min(sp.q_len, a + QUERY_CHUNK)
            n_keys = sp.context_len - sp.q_len + b
            qs = q[sp.q_start + a : sp.q_start + b].transpose(1, 0, 2)[None]  # [1, Hq, L, D]
            o = mx.fast.scaled_dot_product_attention(
                qs,
                k[:, :, :n_keys],
                v[:, :, :n_keys],
                scale=scale,
                mask="causal" if b - a > 1 else None,
            )
            outs.append(o[0].transpose(1, 0, 2))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
