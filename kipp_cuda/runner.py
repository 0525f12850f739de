"""The model runner: where scheduling meets tensors. Turns a ModelInput into flat device tensors and
attention metadata, runs the model (decode through CUDA graphs captured at bucketed batch sizes),
and samples on the device."""

from __future__ import annotations

import logging

import numpy as np
import torch

from kipp_core.backend import ModelInput, SeqOutput
from kipp_core.spec_decode import verify_drafts
from kipp_cuda.attention import AttentionMetadata, LayerKV
from kipp_cuda.model import Qwen3Model
from kipp_cuda.sampler import sample_rows, token_logprobs

log = logging.getLogger("kipp")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class ModelRunner:
    def __init__(self, model: Qwen3Model, kv_caches: list[LayerKV], block_size: int,
                 device: torch.device, max_num_seqs: int, max_model_len: int,
                 use_graphs: bool):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.device = block_size, device
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_bs: list[int] = []
        if use_graphs:
            self.capture()

    # -- inputs ---------------------------------------------------------------------------------

    def _prepare(self, batch: ModelInput):
        seqs = batch.seqs
        bs = self.block_size
        q_lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int32, count=len(seqs))
        starts = np.fromiter((s.start_pos for s in seqs), dtype=np.int64, count=len(seqs))
        ids = np.fromiter((t for s in seqs for t in s.token_ids), dtype=np.int64,
                          count=int(q_lens.sum()))
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, q_lens)])
        width = max(len(s.block_table) for s in seqs)
        bt = np.zeros((len(seqs), width), dtype=np.int32)
        for i, s in enumerate(seqs):
            bt[i, : len(s.block_table)] = s.block_table
        seq_idx = np.repeat(np.arange(len(seqs)), q_lens)
        slots = bt[seq_idx, positions // bs].astype(np.int64) * bs + positions % bs
        ctx = (starts + q_lens).astype(np.int32)
        return ids, positions, slots, bt, ctx, q_lens

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)

    # -- forward --------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ModelInput) -> torch.Tensor:
        """Hidden states [T, hidden] for every new token of the batch."""
        ids, positions, slots, bt, ctx, q_lens = self._prepare(batch)
        B = len(batch.seqs)
        is_decode = bool((q_lens == 1).all())
        if is_decode and self.graphs and B <= self.graph_bs[-1]:
            return self._replay(ids, positions, slots, bt, ctx)
        cu = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots), block_tables=self._tensor(bt),
            context_lens=self._tensor(ctx), is_decode=is_decode,
            cu_seqlens_q=None if is_decode else self._tensor(cu), max_q_len=int(q_lens.max()),
            max_context_len=int(ctx.max()))
        return self.model(self._tensor(ids), self._tensor(positions), self.kv_caches, meta)

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> list[SeqOutput]:
        hidden = self.forward(batch)
        # Which rows need logits: every row (return_logits), score rows, the sampling rows.
        rows, spans = [], []
        off = 0
        for s in batch.seqs:
            n = len(s.token_ids)
            want = set()
            if s.return_logits:
                want.update(range(n))
            if s.score_targets:
                want.update(range(s.score_start, s.score_start + len(s.score_targets)))
            if s.sampler is not None:
                want.update(range(n - len(s.draft_token_ids) - 1, n))
            local = sorted(want)
            spans.append({r: len(rows) + i for i, r in enumerate(local)})
            rows.extend(off + r for r in local)
            off += n
        outs = [SeqOutput() for _ in batch.seqs]
        if not rows:
            return outs
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
        plain = [(i, s) for i, s in enumerate(batch.seqs)
                 if s.sampler is not None and not s.draft_token_ids]
        if plain:
            idx = [spans[i][len(s.token_ids) - 1] for i, s in plain]
            toks, lps = sample_rows(logits[idx], [s.sampler for _, s in plain],
                                    [s.num_logprobs for _, s in plain])
            for j, (i, _) in enumerate(plain):
                outs[i].token_ids = [toks[j]]
                if lps is not None and lps[j] is not None:
                    outs[i].logprobs = [lps[j]]
        for i, s in enumerate(batch.seqs):
            sp = spans[i]
            n = len(s.token_ids)
            if s.sampler is not None and s.draft_token_ids:
                k = len(s.draft_token_ids)
                r = [sp[j] for j in range(n - k - 1, n)]
                host = logits[r].cpu().numpy()
                outs[i].token_ids = verify_drafts(host, s.sampler, s.draft_token_ids,
                                                  s.draft_probs)
                if s.num_logprobs is not None:
                    outs[i].logprobs = token_logprobs(logits[r[: len(outs[i].token_ids)]],
                                                      outs[i].token_ids, s.num_logprobs)
            if s.score_targets:
                r = [sp[j] for j in range(s.score_start, s.score_start + len(s.score_targets))]
                outs[i].scores = token_logprobs(logits[r], s.score_targets, s.num_score_logprobs)
            if s.return_logits:
                outs[i].logits = logits[[sp[j] for j in range(n)]].cpu().numpy()
        return outs

    # -- CUDA graphs ----------------------------------------------------------------------------

    def capture(self) -> None:
        """Capture decode at bucketed batch sizes, largest first; smaller ones share its pool."""
        dev, H = self.device, self.model.config.hidden_size
        n = self.max_num_seqs
        self.g_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.g_pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.g_slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.g_ctx = torch.ones(n, dtype=torch.int32, device=dev)
        self.g_bt = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=dev)
        self.g_out = torch.zeros((n, H), dtype=self.model.dtype, device=dev)
        self.graph_bs = graph_batch_sizes(n)
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.graph_bs):
                meta = AttentionMetadata(self.g_slots[:bs], self.g_bt[:bs], self.g_ctx[:bs],
                                         is_decode=True, max_context_len=self.max_model_len)
                args = (self.g_ids[:bs], self.g_pos[:bs], self.kv_caches, meta)
                self.g_out[:bs] = self.model(*args)  # warm-up: compiles kernels outside capture
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.g_out[:bs] = self.model(*args)
                pool = g.pool() if pool is None else pool
                self.graphs[bs] = g
        torch.cuda.synchronize(dev)

    def _replay(self, ids, positions, slots, bt, ctx) -> torch.Tensor:
        B = len(ids)
        bs = next(b for b in self.graph_bs if b >= B)
        w = bt.shape[1]
        self.g_ids[:B].copy_(self._tensor(ids))
        self.g_pos[:B].copy_(self._tensor(positions))
        self.g_slots[:B].copy_(self._tensor(slots))
        self.g_slots[B:bs].fill_(-1)  # padding rows write no KV
        self.g_ctx[:B].copy_(self._tensor(ctx))
        self.g_ctx[B:bs].fill_(1)
        self.g_bt[:B, :w].copy_(self._tensor(bt))
        self.graphs[bs].replay()
        return self.g_out[:B]

