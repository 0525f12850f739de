"""The MLX backend: kipp_core's backend contract on the Qwen3 model in MLX.

One step is one forward over the whole step (every sequence's new tokens packed into a flat
batch, decode sequences first), then logits only for the rows that need them: one per sampling
sequence (sampled on the device in one batch), k+1 for speculative verification (verified on the
host by kipp_core.spec_decode.verify_drafts), the score rows, or every row when asked for logits.
`execute_async` queues a plain step with mx.async_eval and returns, so the engine builds the next
step's graph while the device runs this one (mlx-lm's generation loop overlaps the same way); the
next step's PENDING ids are this step's samples, taken on the device.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kipp_core.backend import (
    PENDING,
    BackendOptions,
    ModelInput,
    SeqInput,
    SeqOutput,
    score_in_chunks,
)
from kipp_core.checkpoint import Checkpoint
from kipp_core.fastpath import kernel_disabled, report_fallback
from kipp_core.prompt_end import NUM_HIDDEN_SLOTS
from kipp_core.spec_decode import verify_drafts
from kipp_mlx.attention import AttentionMetadata
from kipp_mlx.decode_graph import DecodeGraph
from kipp_mlx.kernels.ladder import gpu_kind
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
        ctx = min(opts.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.model = load_model(
            checkpoint,
            self.dtype,
            opts.quant,
            max_positions=ctx,
            block_size=bs,
        )
        self.block_size = bs
        self.num_blocks = num_kv_blocks(opts, cfg, self.dtype.size)
        self.kv_bytes_per_token = PagedKVCache.bytes_per_token(cfg, self.dtype.size, opts.kv_quant)
        self.kv = PagedKVCache.for_config(cfg, self.num_blocks, bs, self.dtype, opts.kv_quant)
        self.num_hidden_slots = NUM_HIDDEN_SLOTS  # prompt-end hidden states
        self.end_hidden: dict[int, mx.array] = {}
        self.decode_attention = None if opts.kv_quant else self.model.kernels.decode_attention
        self.decode_graph = self._decode_graph()
        # the last step's samples: [(tokens [R] on the device, {seq_id: row})]
        self._last: list = []
        self._log_load(checkpoint)

    def _decode_graph(self) -> DecodeGraph | None:
        """The compiled decode step (kipp_mlx.decode_graph) on a GPU with a dense KV cache;
        KIPP_MLX_COMPILE=1 takes it on the CPU too, =0 or KIPP_MLX_DISABLE_KERNELS=decode_graph
        keeps every step eager."""
        env = os.environ.get("KIPP_MLX_COMPILE", "").strip()
        if self.options.kv_quant or env == "0" or kernel_disabled("mlx", "decode_graph"):
            return None
        if env != "1" and gpu_kind() is None:
            return None
        return DecodeGraph(self.model, self.kv, self.decode_attention)

    def _graph_step(self, seqs: list[SeqInput]):
        """(hidden, meta) of a decode step through the compiled graph; None where the step is
        not one it takes, or where tracing failed (logged once, fatal under
        KIPP_MLX_REQUIRE_KERNELS=1; the eager step runs from then on)."""
        if not DecodeGraph.takes(seqs):
            return None
        ids = self._input_ids(seqs)  # its errors are the step's, not the graph's
        try:
            hidden, spans = self.decode_graph(seqs, ids)
        except Exception as e:  # a trace MLX cannot compile: the eager step is the reference
            self.decode_graph = None
            report_fallback("mlx", "decode_graph", f"{type(e).__name__}: {e}")
            return None
        return hidden, AttentionMetadata.for_spans(spans)

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
        return self._step(batch.seqs).result()

    def execute_async(self, batch: ModelInput) -> _Pending:
        """Queue the step (mx.async_eval) and return; only plain sampling is left pending (a step
        asking for logprobs, scores, drafts, raw logits or a prompt-end hit is computed here).
        A PENDING token of the batch is this backend's previous sample for the same sequence."""
        return self._step(batch.seqs)

    def _step(self, seqs: list[SeqInput]) -> _Pending:
        self._prev, self._last = self._last, []
        hits = [s for s in seqs if s.cached_hidden is not None]
        cached = self._hits(hits) if hits else []
        rest = [s for s in seqs if s.cached_hidden is None]
        # decode sequences first: they share one batched attention (kipp_mlx.attention)
        order = sorted(range(len(rest)), key=lambda i: len(rest[i].token_ids) != 1)
        run = self._run([rest[i] for i in order]) if rest else _Pending([], [], None)
        return _Pending.merged(seqs, cached, run, order)

    def _hits(self, hits: list[SeqInput]) -> list[SeqOutput]:
        """Prompt-end hits, first: their tail blocks and slots are read before this step writes."""
        for s in hits:
            if s.copy_block is not None:
                self.kv.reserve(max(s.copy_block))
                self.kv.copy_block(*s.copy_block)
        rows = mx.stack([self.end_hidden[s.cached_hidden] for s in hits]).astype(self.dtype)
        step = _CachedRows(self.model, rows)
        step.seqs = hits
        cached = [SeqOutput() for _ in hits]
        self._sample_plain(step, cached, sync=True)
        for i, s in enumerate(hits):
            if s.return_logits:
                cached[i].logits = np.array(step.rows(i, 0, 1))
        mx.eval(self.kv.arrays())
        return cached

    def _input_ids(self, seqs: list[SeqInput]) -> mx.array:
        """The step's token ids [T]; PENDING ones are the last step's samples, on the device."""
        flat = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64)
        dst = np.flatnonzero(flat == PENDING)
        ids = mx.array(np.where(flat == PENDING, 0, flat).astype(np.int32))
        if not len(dst):
            return ids
        rows, base = {}, 0
        for toks, part in self._prev:  # hits' and the run's samples, one array
            rows.update((sid, base + r) for sid, r in part.items())
            base += toks.shape[0]
        parts = [t for t, _ in self._prev]
        toks = parts[0] if len(parts) == 1 else mx.concatenate(parts) if parts else None
        seq_of = np.searchsorted(np.cumsum([len(s.token_ids) for s in seqs]), dst, side="right")
        missing = [seqs[i].seq_id for i in seq_of if seqs[i].seq_id not in rows]
        if missing:
            raise ValueError(
                f"PENDING tokens for seqs {missing}, which the last step did not sample"
            )
        src = mx.array(np.array([rows[seqs[i].seq_id] for i in seq_of], dtype=np.int32))
        ids[mx.array(dst.astype(np.int32))] = toks[src].astype(mx.int32)
        return ids

    def _run(self, seqs: list[SeqInput]) -> _Pending:
        bs = self.block_size
        self.kv.reserve(
            max(max(s.block_table[: -(-(s.start_pos + len(s.token_ids)) // bs)]) for s in seqs)
        )
        graph = self._graph_step(seqs) if self.decode_graph is not None else None
        if graph is not None:
            hidden, meta = graph
        else:
            meta = AttentionMetadata.build(seqs, bs, self.decode_attention)
            hidden = self.model(self._input_ids(seqs), meta, self.kv)  # [T, hidden]
        for s, sp in zip(seqs, meta.spans):
            if s.save_hidden is not None:  # a copy, so the step's hidden states are not kept
                row = hidden[sp.q_start + sp.q_len - 1]
                self.end_hidden[s.save_hidden] = row.astype(mx.float32)
        step = _Step(self.model, hidden, meta, seqs)
        outs = [SeqOutput() for _ in seqs]
        plain, toks = self._sample_plain(step, outs, sync=False)
        extras = any(
            s.draft_token_ids or s.score_targets or s.return_logits or s.num_logprobs is not None
            for s in seqs
        )
        if not extras:
            mx.async_eval(*([toks] if toks is not None else []), *self.kv.arrays())
            return _Pending(outs, plain, toks)
        pending = _Pending(outs, plain, toks)
        outs = pending.result()
        for i, s in enumerate(seqs):
            if s.sampler is not None and s.draft_token_ids:
                self._verify(step, i, outs[i])
            if s.score_targets:
                self._score(step, i, outs[i])
            if s.return_logits:
                outs[i].logits = np.array(step.rows(i, 0, len(s.token_ids)))
        self._logprobs(step, plain, outs)
        mx.eval(self.kv.arrays())  # the step's KV writes land even when no row was read
        return _Pending(outs, [], None)

    def _sample_plain(self, step, outs: list[SeqOutput], sync: bool):
        """Sample every plain row (a sampler, no drafts) in one batch: (their indices, the tokens
        on the device). The last step's samples are remembered for PENDING ids."""
        idx = [
            i for i, s in enumerate(step.seqs) if s.sampler is not None and not s.draft_token_ids
        ]
        if not idx:
            return idx, None
        step.plain_logits = logits = step.last_rows(idx)  # [R, vocab]
        toks = sample(logits, [step.seqs[i].sampler for i in idx])
        self._last.append((toks, {step.seqs[i].seq_id: r for r, i in enumerate(idx)}))
        if sync:
            _Pending(outs, idx, toks).result()
            self._logprobs(step, idx, outs)
        return idx, toks

    def _logprobs(self, step, idx: list[int], outs: list[SeqOutput]) -> None:
        want = [r for r, i in enumerate(idx) if step.seqs[i].num_logprobs is not None]
        if not want:
            return
        sel = mx.array(want, dtype=mx.int32)
        lps = token_logprobs(
            step.plain_logits[sel],
            [outs[idx[r]].token_ids[0] for r in want],
            [step.seqs[idx[r]].num_logprobs for r in want],
        )
        for r, lp in zip(want, lps):
            outs[idx[r]].logprobs = [lp]

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
        row0, n = s.score_start, s.num_score_logprobs
        out.scores = score_in_chunks(
            s.score_targets,
            lambda a, t: token_logprobs(step.rows(i, row0 + a, row0 + a + len(t)), t, [n] * len(t)),
        )


class _Pending:
    """A step's outputs; the plain rows' sampled tokens are read from the device in `result()`."""

    def __init__(self, outs: list[SeqOutput], rows: list[int], tokens: mx.array | None):
        self.outs, self.rows, self.tokens = outs, rows, tokens

    def result(self) -> list[SeqOutput]:
        if self.tokens is not None:
            for i, t in zip(self.rows, self.tokens.tolist()):
                self.outs[i].token_ids = [t]
            self.tokens = None
        return self.outs

    @classmethod
    def merged(cls, seqs, cached: list[SeqOutput], run: _Pending, order: list[int]) -> _Pending:
        """The step's outputs in the batch's order: prompt-end hits, and the run's rows (run in
        `order`)."""
        if not cached and order == sorted(order):
            return run
        return _Merged(seqs, cached, run, order)


class _Merged(_Pending):
    def __init__(self, seqs, cached, run: _Pending, order: list[int]):
        super().__init__([], [], None)
        self.seqs, self.cached, self.run, self.order = seqs, cached, run, order

    def result(self) -> list[SeqOutput]:
        ran = self.run.result()
        by_rest = [None] * len(ran)
        for pos, i in enumerate(self.order):
            by_rest[i] = ran[pos]
        cached, rest = iter(self.cached), iter(by_rest)
        return [next(cached) if s.cached_hidden is not None else next(rest) for s in self.seqs]


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
        last = [sp[i].q_start + sp[i].q_len - 1 for i in idx]
        if last == list(range(self.hidden.shape[0])):  # a pure decode step: every row
            return self.model.logits(self.hidden)
        return self.model.logits(self.hidden[mx.array(last, dtype=mx.int32)])


class _CachedRows:
    """_Step's interface over saved hidden states (prompt-end hits), one row a sequence."""

    def __init__(self, model, hidden: mx.array):
        self.logits = model.logits(hidden)  # [H, vocab] float32

    def rows(self, i: int, lo: int, hi: int) -> mx.array:
        return self.logits[i + lo : i + hi]

    def last_rows(self, idx: list[int]) -> mx.array:
        return self.logits[mx.array(idx, dtype=mx.int32)]
