"""Attention over the paged KV cache, and the step's metadata that drives it.

A step is one flat batch of T new tokens, its decode sequences (one new token each) first. Each
sequence's queries attend causally over its whole context (cached tokens plus its own new ones):
- the decode rows: one batched attention over the block tables, through the paged decode kernel
  (kipp_mlx.kernels.decode_attention) when the ladder chose it, else its reference (the slots
  gathered, padded to the longest context, and masked SDPA); a step of decode rows alone runs as
  one compiled graph on a GPU (kipp_mlx.decode_graph);
- every other sequence (prefill chunks, verification rows): its cached prefix's slots gathered
  into one contiguous copy beside its own new K/V, then causal attention with lower-right
  alignment (kipp_mlx.prefill_attention: one fused SDPA on a GPU, else query chunks of SDPA, or
  key tiles where SDPA would hold every score). The copy moves O(context) bytes against O(new
  tokens x context) FLOPs of attention, under 5% of a 2,048-token chunk's attention time even at
  a 131,072-token context; a prompt with nothing cached reads nothing back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kipp_mlx.kernels.decode_attention import sdpa_padded
from kipp_mlx.kv_cache import PagedKVCache
from kipp_mlx.prefill_attention import QUERY_CHUNK, fused_sdpa, prefill_attention

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
    context_slots: mx.array | None  # [sum context_len] int32 of the per-sequence rows
    num_decode: int  # the first num_decode sequences (rows) take the batched decode path
    # the decode rows: the kernel's view ...
    block_tables: mx.array | None = None  # [num_decode, max_blocks] int32
    context_lens: mx.array | None = None  # [num_decode] int32
    max_context: int = 0
    # ... and the reference's: slots padded to the longest context, and the padding mask
    decode_slots: mx.array | None = None  # [num_decode, S] int32
    decode_mask: mx.array | None = None  # [num_decode, 1, 1, S] bool, None when nothing is padded
    decode_attention: Callable | None = None  # the decode kernel, when the ladder chose one

    @classmethod
    def build(cls, seqs, block_size: int, decode_attention: Callable | None = None):
        """From the step's SeqInputs (token_ids, start_pos, block_table), decode ones first."""
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
        num_decode = 0
        while num_decode < len(spans) and spans[num_decode].q_len == 1:
            num_decode += 1
        if num_decode and decode_attention is None:
            # Padding every context to the longest wastes memory on ragged batches: past the
            # limit, decode rows take the per-sequence path.
            longest = max(sp.context_len for sp in spans[:num_decode])
            if num_decode * longest > MAX_PADDED_SLOTS:
                num_decode = 0
        rest = ctx_slots[num_decode:]
        meta = cls(
            positions=mx.array(np.concatenate(positions).astype(np.int32)),
            slot_mapping=mx.array(np.concatenate(slot_mapping).astype(np.int32)),
            spans=spans,
            context_slots=mx.array(np.concatenate(rest).astype(np.int32)) if rest else None,
            num_decode=num_decode,
        )
        if num_decode:
            meta._add_decode(seqs[:num_decode], ctx_slots[:num_decode], block_size)
            meta.decode_attention = decode_attention
        return meta

    @classmethod
    def for_spans(cls, spans: list[SeqSpan]):
        """Only the spans: what a step's logits need after a forward that built its own."""
        return cls(None, None, spans, None, len(spans))

    def _add_decode(self, seqs, ctx_slots, block_size) -> None:
        lens = np.array([len(s) for s in ctx_slots], dtype=np.int32)
        self.max_context = S = int(lens.max())
        self.context_lens = mx.array(lens)
        nb = -(-lens // block_size)
        tables = np.zeros((len(seqs), int(nb.max())), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, : nb[i]] = s.block_table[: nb[i]]
        self.block_tables = mx.array(tables)
        padded = np.zeros((len(ctx_slots), S), dtype=np.int32)
        for i, s in enumerate(ctx_slots):
            padded[i, : len(s)] = s
        self.decode_slots = mx.array(padded)
        if (lens != S).any():
            self.decode_mask = mx.array(np.arange(S)[None, :] < lens[:, None])[:, None, None, :]


def attend(
    q: mx.array,
    kv_new: mx.array,
    kv: PagedKVCache,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> mx.array:
    """q: [T, Hq, D] (post-RoPE); kv_new [T, 2, Hkv, D] the new tokens' K/V, already written to
    `kv`. Returns [T, Hq, D]."""
    outs = []
    nd = meta.num_decode
    if nd:
        qd = q[:nd] if nd < q.shape[0] else q
        if meta.decode_attention is not None and not kv.kv_quant:
            outs.append(
                meta.decode_attention(
                    qd,
                    kv.pool(layer),
                    meta.block_tables,
                    meta.context_lens,
                    scale,
                    kv.block_size,
                    max_context=meta.max_context or None,  # None: the tables' width
                )
            )
        else:
            k, v = kv.read(layer, meta.decode_slots)  # [B, S, Hkv, D]
            outs.append(sdpa_padded(qd, k, v, meta.decode_mask, scale))
    c0 = 0
    fused = fused_sdpa(q.dtype, q.shape[2])
    for sp in meta.spans[nd:]:
        k, v = _context(kv_new, kv, layer, meta.context_slots[c0 : c0 + sp.context_len], sp)
        c0 += sp.context_len
        k, v = k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None]  # [1, Hkv, ctx, D]
        # Unfused, long prefills run in query chunks; a chunk ending at row b sees keys up to
        # ctx - L + b (lower-right causal alignment), in key tiles past SCORE_TILE scores.
        chunk = sp.q_len if fused else QUERY_CHUNK
        for a in range(0, sp.q_len, chunk):
            b = min(sp.q_len, a + chunk)
            n_keys = sp.context_len - sp.q_len + b
            qs = q[sp.q_start + a : sp.q_start + b].transpose(1, 0, 2)[None]  # [1, Hq, L, D]
            o = prefill_attention(qs, k[:, :, :n_keys], v[:, :, :n_keys], scale)
            outs.append(o[0].transpose(1, 0, 2))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def _context(kv_new, kv: PagedKVCache, layer: int, slots: mx.array, sp: SeqSpan):
    """K, V [ctx, Hkv, D] of a prefill span: its cached prefix read from the pool, its own new
    rows from kv_new, not gathered back (a q8_0 cache reads everything back, its new rows
    rounded as stored)."""
    if kv.kv_quant:
        return kv.read(layer, slots)
    new = kv_new[sp.q_start : sp.q_start + sp.q_len]
    cached = sp.context_len - sp.q_len
    if cached == 0:
        return new[:, 0], new[:, 1]
    k, v = kv.read(layer, slots[:cached])
    return mx.concatenate([k, new[:, 0]]), mx.concatenate([v, new[:, 1]])
