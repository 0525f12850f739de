"""The MLX backend: kipp_core's backend contract on the Qwen3 model in MLX.

One `execute` is one forward over the whole step (every sequence's new tokens packed into a flat
batch), then logits only for the rows that need them: one per sampling sequence (sampled on the
device in one batch), k+1 for speculative verification (verified on the host by
kipp_core.spec_decode.verify_drafts), the score rows, or every row when asked for logits.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kipp_core.backend import SCORE_CHUNK, BackendOptions, ModelInput, SeqInput, SeqOutput
from kipp_core.checkpoint import Checkpoint
from kipp_core.prompt_end import NUM_HIDDEN_SLOTS
from kipp_core.spec_decode import verify_drafts
from kipp_mlx.attention import AttentionMetadata
from kipp_mlx.kernels import ladder
from kipp_mlx.kernels.paged_attention import paged_attention_ref
from kipp_mlx.kv_budget import num_kv_blocks
from kipp_mlx.kv_cache import PagedKVCache
from kipp_mlx.loader import load_model
from kipp_mlx.logprobs import token_logprobs
from kipp_mlx.sampler import sample

log = logging.getLogger("kipp")

DTYPES = {None: mx.bfloat16, "bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


class MlxBackend:
    """The Qwen3 model in MLX (Metal on Apple silicon, else MLX's CPU or CUDA build)."""

    def __init__(self, checkpoint: Checkpoint, options: BackendOptions | None = None):
        opts = options or BackendOptions()
        if opts.dtype not in DTYPES:
            raise ValueError(f"mlx dtype must be bfloat16, float16 or float32, got {opts.dtype!r}")
        if opts.kv_quant not in (None, "q8_0"):
            raise ValueError(f"kv_quant must be None or 'q8_0', got {opts.kv_quant!r}")
        if opts.tensor_parallel != 1:
            raise ValueError(
                f"the mlx backend runs on one device, got tensor_parallel {opts.tensor_parallel!r}"
            )
        bs = opts.block_size
        if isinstance(bs, bool) or not isinstance(bs, int) or bs <= 0:
            raise ValueError(f"block_size must be a positive integer, got {bs!r}")
        if opts.device is not None:
            if opts.device not in ("cpu", "gpu"):
                raise ValueError(f"mlx device must be 'cpu' or 'gpu', got {opts.device!r}")
            mx.set_default_device(mx.cpu if opts.device == "cpu" else mx.gpu)
        self.options = opts
        self.dtype = DTYPES[opts.dtype]
        cfg = self.config = checkpoint.config
        self.model = load_model(
            checkpoint, self.dtype, opts.quant, compile_act=not opts.enforce_eager
        )
        self.block_size = bs
        self.num_blocks = num_kv_blocks(opts, cfg, self.dtype.size)
        self.kv = PagedKVCache.for_config(cfg, self.num_blocks, bs, self.dtype, opts.kv_quant)
        self.num_hidden_slots = NUM_HIDDEN_SLOTS  # prompt-end hidden states
        self.end_hidden: dict[int, mx.array] = {}
        self.paged_attention = None  # the decode kernel, when the ladder accepts it
        if not opts.kv_quant:
            fn = ladder.paged_attention_fn(
                cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, bs, self.dtype
            )
            self.paged_attention = None if fn is paged_attention_ref else fn
        self._log_load(checkpoint)

    def _log_load(self, checkpoint: Checkpoint) -> None:
        opts = self.options
        weights = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        per_token = PagedKVCache.bytes_per_token(self.config, self.dtype.size, opts.kv_quant)
        quant = opts.quant or (checkpoint.quantization or {}).get("scheme") or "unquantized"
        tokens = self.num_blocks * self.block_size
        log.info(
            "mlx backend on %s: weights %.2f GiB (%s, %s); KV cache up to %.2f GiB (%s): "
            "%d blocks of %d, at most %d tokens in flight",
            mx.default_device(),
            weights / 2**30,
            opts.dtype or "bfloat16",
            quant,
            tokens * per_token / 2**30,
            opts.kv_quant or "dense",
            self.num_blocks,
            self.block_size,
            tokens,
        )

    # -- the step -------------------------------------------------------------------------------

    def execute(self, batch: ModelInput) -> list[SeqOutput]:
        seqs = batch.seqs
        hits = [s for s in seqs if s.cached_hidden is not None]
        if not hits:
            return self._run(seqs)
        # Prompt-end hits first: their tail blocks and slots are read before this step writes.
        for s in hits:
            if s.copy_block is not None:
                self.kv.reserve(max(s.copy_block))
                self.kv.copy_block(*s.copy_block)
        step = _CachedRows(self.model, mx.stack([self.end_hidden[s.cached_hidden] for s in hits]))
        step.seqs = hits
        cached = [SeqOutput() for _ in hits]
        self._sample_plain(step, cached)
        for i, s in enumerate(hits):
            if s.return_logits:
                cached[i].logits = np.array(step.rows(i, 0, 1))
        mx.eval(self.kv.arrays())
        rest = iter(self._run([s for s in seqs if s.cached_hidden is None]))
        cached = iter(cached)
        return [next(cached) if s.cached_hidden is not None else next(rest) for s in seqs]

    def _run(self, seqs: list[SeqInput]) -> list[SeqOutput]:
        if not seqs:
            return []
        bs = self.block_size
        self.kv.reserve(
            max(max(s.block_table[: -(-(s.start_pos + len(s.token_ids)) // bs)]) for s in seqs)
        )
        meta = AttentionMetadata.build(seqs, bs, self.paged_attention)
        ids = mx.array(np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int32))
        hidden = self.model(ids, meta, self.kv)  # [T, hidden]
        for s, sp in zip(seqs, meta.spans):
            if s.save_hidden is not None:  # a copy, so the step's hidden states are not kept
                row = hidden[sp.q_start + sp.q_len - 1].astype(mx.float32)
                self.end_hidden[s.save_hidden] = mx.array(np.array(row)).astype(hidden.dtype)
        step = _Step(self.model, hidden, meta, seqs)
        outs = [SeqOutput() for _ in seqs]
        self._sample_plain(step, outs)
        for i, s in enumerate(seqs):
            if s.sampler is not None and s.draft_token_ids:
                self._verify(step, i, outs[i])
            if s.score_targets:
                self._score(step, i, outs[i])
            if s.return_logits:
                outs[i].logits = np.array(step.rows(i, 0, len(s.token_ids)))
        mx.eval(self.kv.arrays())  # the step's KV writes land even when no row was read
        return outs

    def _sample_plain(self, step: _Step, outs: list[SeqOutput]) -> None:
        idx = [
            i for i, s in enumerate(step.seqs) if s.sampler is not None and not s.draft_token_ids
        ]
        if not idx:
            return
        logits = step.last_rows(idx)  # [R, vocab]
        toks = sample(logits, [step.seqs[i].sampler for i in idx])
        mx.eval(toks, *self.kv.arrays())
        toks = toks.tolist()
        want = [r for r, i in enumerate(idx) if step.seqs[i].num_logprobs is not None]
        lps = []
        if want:
            sel = mx.array(want, dtype=mx.int32)
            lps = token_logprobs(
                logits[sel], [toks[r] for r in want], [step.seqs[idx[r]].num_logprobs for r in want]
            )
        lp_of = dict(zip(want, lps))
        for r, i in enumerate(idx):
            outs[i].token_ids = [toks[r]]
            if r in lp_of:
                outs[i].logprobs = [lp_of[r]]

    def _verify(self, step: _Step, i: int, out: SeqOutput) -> None:
        s = step.seqs[i]
        k, n = len(s.draft_token_ids), len(s.token_ids)
        rows = step.rows(i, n - k - 1, n)
        out.token_ids = verify_drafts(np.array(rows), s.sampler, s.draft_token_ids, s.draft_probs)
        if s.num_logprobs is not None:
            m = len(out.token_ids)
            out.logprobs = token_logprobs(rows[:m], out.token_ids, [s.num_logprobs] * m)

    def _score(self, step: _Step, i: int, out: SeqOutput) -> None:
        s = step.seqs[i]
        out.scores = []
        targets = s.score_targets
        for a in range(0, len(targets), SCORE_CHUNK):
            t = targets[a : a + SCORE_CHUNK]
            rows = step.rows(i, s.score_start + a, s.score_start + a + len(t))
            out.scores += token_logprobs(rows, t, [s.num_score_logprobs] * len(t))


class _Step:
    """Logits of the rows a step needs, computed at most once per sequence when all are wanted."""

    def __init__(self, model, hidden: mx.array, meta: AttentionMetadata, seqs: list[SeqInput]):
        self.model, self.hidden, self.meta, self.seqs = model, hidden, meta, seqs
        self._full: dict[int, mx.array] = {}

    def rows(self, i: int, lo: int, hi: int) -> mx.array:
        """Logits [hi - lo, vocab] float32 of rows lo..hi of sequence i."""
        sp = self.meta.spans[i]
        q0 = sp.q_start
        if self.seqs[i].return_logits:
            if i not in self._full:
                self._full[i] = self.model.logits(self.hidden[q0 : q0 + sp.q_len])
            return self._full[i][lo:hi]
        return self.model.logits(self.hidden[q0 + lo : q0 + hi])

    def last_rows(self, idx: list[int]) -> mx.array:
        if any(self.seqs[i].return_logits for i in idx):
            return mx.concatenate(
                [
                    self.rows(i, len(self.seqs[i].token_ids) - 1, len(self.seqs[i].token_ids))
                    for i in idx
                ]
            )
        sp = self.meta.spans
        last = mx.array([sp[i].q_start + sp[i].q_len - 1 for i in idx], dtype=mx.int32)
        return self.model.logits(self.hidden[last])


class _CachedRows:
    """_Step's interface over saved hidden states (prompt-end hits), one row a sequence."""

    def __init__(self, model, hidden: mx.array):
        self.logits = model.logits(hidden)  # [H, vocab] float32

    def rows(self, i: int, lo: int, hi: int) -> mx.array:
        return self.logits[i + lo : i + hi]

    def last_rows(self, idx: list[int]) -> mx.array:
        return self.logits[mx.array(idx, dtype=mx.int32)]
