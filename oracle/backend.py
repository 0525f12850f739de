"""The oracle as an engine backend: paged KV in numpy, one sequence at a time, sampling by the
numpy reference in kipp_core.sampling. Every engine test runs on it with no torch or mlx."""

from __future__ import annotations

import os

import numpy as np

from kipp_core.backend import BackendOptions, ModelInput, SeqInput, SeqOutput, score_in_chunks
from kipp_core.checkpoint import Checkpoint
from kipp_core.kv_memory import parse_kv_memory
from kipp_core.prompt_end import NUM_HIDDEN_SLOTS
from kipp_core.sampling import logprobs, logprobs_rows, sample
from kipp_core.spec_decode import verify_drafts
from oracle.qwen3 import compute_logits, forward_hidden, load_weights

DTYPES = {None: np.float32, "float32": np.float32, "float64": np.float64}


def _free_ram() -> int:
    """Available system memory (all of it where the OS does not say)."""
    pages = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else None
    return os.sysconf("SC_PAGE_SIZE") * (pages or os.sysconf("SC_PHYS_PAGES"))


class PagedKV:
    """KV in fixed-size blocks, allocated on first write: block -> k, v of [layers, bs, Hkv, D]."""

    def __init__(self, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype):
        self.shape = (num_layers, block_size, num_kv_heads, head_dim)
        self.block_size = block_size
        self.dtype = dtype
        self.blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def view(self, block_table: list[int], start_pos: int) -> _SeqView:
        return _SeqView(self, block_table, start_pos)

    def block(self, bid: int) -> tuple[np.ndarray, np.ndarray]:
        if bid not in self.blocks:
            # NaN-poisoned: a read of a slot nothing wrote shows up at once.
            self.blocks[bid] = (
                np.full(self.shape, np.nan, self.dtype),
                np.full(self.shape, np.nan, self.dtype),
            )
        return self.blocks[bid]


class _SeqView:
    """The oracle's `cache` argument for one sequence: writes new K/V, returns the whole context."""

    def __init__(self, kv: PagedKV, block_table: list[int], start_pos: int):
        self.kv, self.block_table, self.start_pos = kv, block_table, start_pos

    def update_and_fetch(self, layer: int, k: np.ndarray, v: np.ndarray):
        bs = self.kv.block_size
        for j in range(k.shape[0]):
            pos = self.start_pos + j
            kb, vb = self.kv.block(self.block_table[pos // bs])
            kb[layer, pos % bs] = k[j]
            vb[layer, pos % bs] = v[j]
        total = self.start_pos + k.shape[0]
        nb = -(-total // bs)
        ks = np.concatenate([self.kv.block(b)[0][layer] for b in self.block_table[:nb]])[:total]
        vs = np.concatenate([self.kv.block(b)[1][layer] for b in self.block_table[:nb]])[:total]
        return ks, vs


class OracleBackend:
    def __init__(self, checkpoint: Checkpoint, options: BackendOptions | None = None):
        opts = options or BackendOptions()
        dtype = opts.dtype
        if dtype not in DTYPES:
            raise ValueError(f"oracle dtype must be float32 or float64, got {dtype!r}")
        if opts.quant or opts.kv_quant:
            raise ValueError(
                "the oracle runs unquantized weights and KV only; quantized "
                "checkpoints are dequantized at load instead"
            )
        self.config = checkpoint.config
        self.weights = load_weights(checkpoint, DTYPES[dtype])
        block_size = opts.block_size
        self.block_size = block_size
        # Blocks are allocated lazily, so the default pool can be generous: 8 full contexts.
        ctx = min(
            opts.max_model_len or self.config.max_position_embeddings,
            self.config.max_position_embeddings,
        )
        self.num_blocks = opts.num_blocks or 8 * -(-ctx // block_size)
        c = self.config
        itemsize = np.dtype(DTYPES[dtype]).itemsize  # blocks are allocated on first write
        self.kv_bytes_per_token = (
            2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * itemsize
        )
        if opts.kv_cache_memory is not None and not opts.num_blocks:  # a cap on that pool
            kind, v = parse_kv_memory(opts.kv_cache_memory)
            per_block = int(self.kv_bytes_per_token * block_size)
            self.num_blocks = int((v * _free_ram() if kind == "fraction" else v) // per_block)
            if self.num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory {opts.kv_cache_memory!r} holds no KV block "
                    f"({per_block} bytes)"
                )
        self.num_hidden_slots = NUM_HIDDEN_SLOTS  # prompt-end hidden states
        self.serial_seqs = True  # one sequence at a time: a step costs the sum of its sequences
        self.hidden_slots: dict[int, np.ndarray] = {}
        self.kv = PagedKV(
            c.num_hidden_layers, block_size, c.num_key_value_heads, c.head_dim, DTYPES[dtype]
        )

    def execute(self, batch: ModelInput) -> list[SeqOutput]:
        # Prompt-end hits first: their slots and tail blocks are read before this step writes.
        cached = {
            i: self._from_cache(s) for i, s in enumerate(batch.seqs) if s.cached_hidden is not None
        }
        return [self._run(s, cached.get(i)) for i, s in enumerate(batch.seqs)]

    def _from_cache(self, s: SeqInput) -> np.ndarray:
        if s.copy_block is not None:
            src, dst = s.copy_block
            self.kv.blocks[dst] = tuple(a.copy() for a in self.kv.block(src))
        return self.hidden_slots[s.cached_hidden][None]

    def _run(self, s: SeqInput, hidden: np.ndarray | None = None) -> SeqOutput:
        if hidden is None:
            view = self.kv.view(s.block_table, s.start_pos)
            hidden = forward_hidden(self.weights, s.token_ids, s.start_pos, view)
        if s.save_hidden is not None:
            self.hidden_slots[s.save_hidden] = hidden[-1].copy()
        out = SeqOutput()
        if s.return_logits:
            out.logits = compute_logits(self.weights, hidden).astype(np.float32)
        if s.score_targets:

            def score_rows(a: int, t: list[int]) -> list:
                row0 = s.score_start + a
                rows = self._logits(hidden[row0 : row0 + len(t)], out, row0)
                return logprobs_rows(rows, t, s.num_score_logprobs)

            out.scores = score_in_chunks(s.score_targets, score_rows)
        if s.sampler is not None:
            k = len(s.draft_token_ids)
            rows = self._logits(hidden[-(k + 1) :], out, len(s.token_ids) - k - 1)
            if k:
                out.token_ids = verify_drafts(rows, s.sampler, s.draft_token_ids, s.draft_probs)
            else:
                out.token_ids = [sample(rows[0], s.sampler)]
            if s.num_logprobs is not None:
                out.logprobs = [
                    logprobs(rows[i], t, s.num_logprobs) for i, t in enumerate(out.token_ids)
                ]
        return out

    def _logits(self, hidden: np.ndarray, out: SeqOutput, row0: int) -> np.ndarray:
        if out.logits is not None:
            return out.logits[row0 : row0 + hidden.shape[0]]
        return compute_logits(self.weights, hidden).astype(np.float32)
