"""The decode step as one compiled MLX graph (mx.compile), beside the eager step it replaces.

On a GPU a small model's decode step costs the host more than the device: MLX builds the graph op
by op from Python (about 1.5 us an op) and then encodes it (entry 652e2ab: 0.6B decode flat at
~3.5 ms a step from 128 to 2,048 tokens of context, where the paged kernel's time grows). mx.compile
traces the forward once per input shape and replays the trace from C++ after that, with its
elementwise ops fused. A step takes this path when every row is a decode row (one new token) and
the KV cache is dense; the rest, and every step with KIPP_MLX_DISABLE_KERNELS=decode_graph, run
the eager forward (the reference).

Shapes are bucketed so that traces are reused: the batch is padded to `batch_bucket` rows, and the
block tables to a power-of-two width (`width_bucket`). A padding row repeats row 0 (its token, its
position, its slot, its block table), so its K/V write stores what row 0's stores, computed the
same way; its output is dropped. The KV pools are inputs and outputs of the graph. With the paged
kernel and the in-place write the q/k-norm kernel writes the new K/V into them (each output is
its input's buffer); else MLX's scatter writes new pools, copying each one the previous step
still holds (kipp_mlx.kernels.qk_norm_rope.qk_norm_rope_write says why).
Decode attention inside the graph is the paged kernel when the ladder chose it, else the padded
reference with its padding mask built in the graph from the lengths.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np

from kipp_mlx.attention import AttentionMetadata, SeqSpan

MIN_WIDTH = 16  # block-table width of the smallest trace (512 tokens at 32 a block)


def batch_bucket(n: int) -> int:
    """Rows of the trace for n decode rows: 1, 2, 4, then multiples of 8 (vLLM's graph sizes)."""
    if n <= 4:
        return 1 << (n - 1).bit_length()
    return -(-n // 8) * 8


def width_bucket(blocks: int) -> int:
    return max(MIN_WIDTH, 1 << (blocks - 1).bit_length())


class DecodeGraph:
    """`model`'s decode forward over `kv` (a dense PagedKVCache), compiled per bucketed shape."""

    def __init__(self, model, kv, decode_attention=None):
        self.model, self.kv, self.decode_attention = model, kv, decode_attention
        self.block_size = kv.block_size
        self._fn = mx.compile(self._forward)

    @staticmethod
    def takes(seqs) -> bool:
        return all(len(s.token_ids) == 1 and s.cached_hidden is None for s in seqs)

    def _forward(self, ids, positions, slots, tables, lens, pools):
        bs = self.block_size
        meta = AttentionMetadata(
            positions=positions,
            slot_mapping=slots,
            spans=[],
            context_slots=None,
            num_decode=ids.shape[0],
            block_tables=tables,
            context_lens=lens,
            decode_attention=self.decode_attention,
        )
        if self.decode_attention is None:  # the padded reference, every table slot gathered
            width = tables.shape[1] * bs
            meta.decode_slots = (tables[:, :, None] * bs + mx.arange(bs)).reshape(-1, width)
            meta.decode_mask = (mx.arange(width)[None, :] < lens[:, None])[:, None, None, :]
        view = copy.copy(self.kv)  # the cache's own write/read, over the trace's pool inputs
        view.kv = list(pools)
        return self.model(ids, meta, view), view.kv

    def __call__(self, seqs, ids: mx.array) -> tuple[mx.array, list[SeqSpan]]:
        """Run the decode rows `seqs` (ids [B] on the device); the pools are replaced by the
        graph's outputs. Returns the hidden states [B, hidden] and each row's span."""
        bs, n = self.block_size, len(seqs)
        rows = batch_bucket(n)
        lens = np.fromiter((s.start_pos + 1 for s in seqs), dtype=np.int32, count=n)
        nb = -(-lens // bs)
        tables = np.zeros((rows, width_bucket(int(nb.max()))), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, : nb[i]] = s.block_table[: nb[i]]
        pos = lens - 1
        slots = tables[np.arange(n), pos // bs] * bs + pos % bs
        if rows > n:  # padding rows repeat row 0
            tables[n:] = tables[0]
            pad = np.zeros(rows - n, dtype=np.intp)
            pos, slots, lens = (np.concatenate([a, a[pad]]) for a in (pos, slots, lens))
            ids = mx.concatenate([ids, mx.broadcast_to(ids[:1], (rows - n,))])
        hidden, pools = self._fn(
            ids,
            mx.array(pos.astype(np.int32)),
            mx.array(slots.astype(np.int32)),
            mx.array(tables),
            mx.array(lens),
            self.kv.kv,
        )
        self.kv.kv[:] = pools
        spans = [SeqSpan(i, 1, int(c)) for i, c in enumerate(lens[:n])]
        return (hidden[:n] if rows > n else hidden), spans
