"""The model runner: turns a ModelInput into flat device tensors and attention metadata, runs the
model, and samples on the device. CUDA graphs, captured at start-up in one memory pool
(graph_sizes.py says which): decode at bucketed batch sizes, the vocabulary head included;
single-sequence prefill padded to a token bucket (padding comes after the real tokens, so causal
attention keeps it out of the real rows, and its K/V is not stored: slot -1). Graph inputs are
staged in a pinned host buffer, uploaded in one copy a step (the large prefill buckets have their
own, so decode's upload stays small). A decode graph writes its argmax into g_last, where the last
step's samples always are, and in the steady state (the same sequences, in order) takes its
PENDING ids from it itself.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kipp_core.backend import ModelInput, SeqOutput, score_in_chunks
from kipp_core.prompt_end import NUM_HIDDEN_SLOTS
from kipp_core.spec_decode import verify_drafts
from kipp_cuda import kv_cache
from kipp_cuda.attention import AttentionMetadata, LayerKV
from kipp_cuda.graph_sizes import PREFILL_GRAPH_TOKENS, graph_batch_sizes, prefill_buckets
from kipp_cuda.model import Qwen3Model
from kipp_cuda.pending import PendingSamples, PinnedRing, in_order, pending_rows
from kipp_cuda.resident import ResidentDecode
from kipp_cuda.sampler import sample_tokens, token_logprobs
from kipp_cuda.staging import FROM, IDS, POS, SLOT, GraphInputs, flat_inputs, upload

log = logging.getLogger("kipp")


class ModelRunner:
    def __init__(
        self,
        model: Qwen3Model,
        kv_caches: list[LayerKV],
        block_size: int,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool,
    ):
        self.model, self.kv_caches = model, kv_caches
        self.block_size, self.device = block_size, device
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.graph_out: dict[tuple[str, int], torch.Tensor] = {}
        self.graph_bs: list[int] = []
        self.prefill_tokens: list[int] = []
        self._last_tokens: torch.Tensor | None = None  # the last step's samples, on the device
        self._last_rows: dict[int, int] = {}  # seq_id -> row of _last_tokens
        # With graphs, _last_tokens is always g_last[:k]: the decode graphs write their argmax
        # there and read their steady-state PENDING ids from it, at one fixed address.
        self.g_last = torch.zeros(max(max_num_seqs, 1), dtype=torch.int64, device=device)
        self.num_hidden_slots = NUM_HIDDEN_SLOTS
        hidden = model.config.hidden_size
        self.end_hidden = torch.zeros((NUM_HIDDEN_SLOTS, hidden), dtype=model.dtype, device=device)
        self._kv_stores = kv_cache.stores(kv_caches)
        self._pins = PinnedRing(max(max_num_seqs, 1), device)
        self.resident = ResidentDecode(max_num_seqs, block_size, device)
        self._published: int | None = None  # the decode replay whose tokens reach the host ring
        if use_graphs:
            self.capture()

    # -- forward --------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [T, hidden], None, None) for every new token of the batch, or (hidden, logits
        [B, V], their argmax [B]) from a decode graph, whose rows are the batch's tokens."""
        ids, positions, slots, bt, ctx, q_lens = flat_inputs(batch, self.block_size)
        pending = pending_rows(batch, ids, q_lens, self._last_rows)
        B, T = len(batch.seqs), len(ids)
        is_decode = bool((q_lens == 1).all())
        if is_decode and self.graph_bs and B <= self.graph_bs[-1]:
            bs = next(b for b in self.graph_bs if b >= B)
            h, logits, top = self._replay(("decode", bs), pending, ids, positions, slots, bt, ctx)
            return h[:B], logits[:B], top[:B]
        if B == 1 and not is_decode and self.prefill_tokens and T <= self.prefill_tokens[-1]:
            tb = next(t for t in self.prefill_tokens if t >= T)
            # Padded queries sit at positions up to start + tb - 1: inside the block table.
            if int(ctx[0]) - T + tb <= self.max_blocks * self.block_size:
                h = self._replay(("prefill", tb), pending, ids, positions, slots, bt, ctx)
                return h[:T], None, None
        cu, dev = np.zeros(B + 1, dtype=np.int32), self.device
        np.cumsum(q_lens, out=cu[1:])
        meta = AttentionMetadata(
            slot_mapping=upload(slots, dev),
            block_tables=upload(bt, dev),
            context_lens=upload(ctx, dev),
            is_decode=is_decode,
            cu_seqlens_q=None if is_decode else upload(cu, dev),
            max_q_len=int(q_lens.max()),
            max_context_len=int(ctx.max()),
        )
        ids_t = upload(ids, dev)
        self._fill_pending(ids_t, pending)
        return self.model(ids_t, upload(positions, dev), self.kv_caches, meta), None, None

    def execute(self, batch: ModelInput) -> list[SeqOutput]:
        return self.execute_async(batch).result()

    @torch.inference_mode()
    def execute_async(self, batch: ModelInput) -> PendingSamples:
        """Queue the step and return without waiting for the device, as long as nothing but
        plain sampling is asked (logprobs, scores, drafts and raw logits wait for their values).
        PENDING tokens of the batch are this runner's previous samples for the same sequences."""
        self._published = None
        hits = [i for i, s in enumerate(batch.seqs) if s.cached_hidden is not None]
        cached, cached_top = self._from_cache(batch, hits) if hits else (None, None)
        run = ModelInput([s for s in batch.seqs if s.cached_hidden is None]) if hits else batch
        # top: the graph's argmax of each logits row (a greedy batch needs no argmax launch)
        hidden, logits, top = self.forward(run) if run.seqs else (None, None, None)
        # Which rows need logits: every row (return_logits), score rows, the sampling rows.
        rows, spans, scored = [], [], []
        off = 0
        for i, s in enumerate(batch.seqs):
            if s.score_targets:  # scored a chunk at a time from the hidden rows
                scored.append((i, off + s.score_start))
            n = len(s.token_ids)
            if s.save_hidden is not None:
                self.end_hidden[s.save_hidden].copy_(hidden[off + n - 1])
            if s.cached_hidden is not None:  # its row follows the computed rows (below)
                spans.append({-1: None})
                continue
            if not (s.return_logits or s.score_targets or s.draft_token_ids):
                # The common case (a decode, the end of a prefill): the last row, if sampling.
                spans.append({n - 1: len(rows)} if s.sampler is not None else {})
                if s.sampler is not None:
                    rows.append(off + n - 1)
                off += n
                continue
            want = set()
            if s.return_logits:
                want.update(range(n))
            if s.sampler is not None:
                want.update(range(n - len(s.draft_token_ids) - 1, n))
            local = sorted(want)
            spans.append({r: len(rows) + i for i, r in enumerate(local)})
            rows.extend(off + r for r in local)
            off += n
        outs = [SeqOutput() for _ in batch.seqs]
        for i, row0 in scored:  # hidden row row0 + j predicts score_targets[j]
            s = batch.seqs[i]

            def score(a, t, row0=row0, n=s.num_score_logprobs):
                rows = hidden[row0 + a : row0 + a + len(t)]
                return token_logprobs(self.model.compute_logits(rows), t, n)

            outs[i].scores = score_in_chunks(s.score_targets, score)
        if not rows and not hits:
            return PendingSamples(outs)
        if rows and logits is None:
            logits = self.model.compute_logits(hidden[self._index(rows)])
        elif rows and len(rows) != logits.shape[0]:
            logits, top = logits[self._index(rows)], None
        if hits:
            for j, i in enumerate(hits):
                spans[i] = {-1: len(rows) + j}
            logits, top = (torch.cat([logits, cached]), None) if rows else (cached, cached_top)
        plain = [
            (i, s)
            for i, s in enumerate(batch.seqs)
            if s.sampler is not None and not s.draft_token_ids
        ]
        self._last_tokens, self._last_rows = None, {}
        ring = None
        if plain:
            idx = [spans[i][len(s.token_ids) - 1] for i, s in plain]
            every = idx == list(range(logits.shape[0]))
            toks, lps = sample_tokens(
                logits if every else logits[idx],
                [s.sampler for _, s in plain],
                [s.num_logprobs for _, s in plain],
                argmax=top if every else None,
            )
            k = toks.shape[0]
            # the graph's own argmax, unprocessed: its step_advance put it in the host ring
            if self._published is not None and toks.data_ptr() == self.g_last.data_ptr():
                ring = (self.resident, self._published)
            if self.graph_bs and k <= self.g_last.shape[0]:
                # Sampled rows, a prompt-end hit, a row subset: not the graph's argmax buffer.
                if toks.data_ptr() != self.g_last.data_ptr():
                    self.g_last[:k].copy_(toks)
                toks = self.g_last[:k]
            self._last_tokens = toks
            self._last_rows = {s.seq_id: j for j, (_, s) in enumerate(plain)}
            for j, (i, _) in enumerate(plain):
                if lps is not None and lps[j] is not None:
                    outs[i].logprobs = [lps[j]]
        for i, s in enumerate(batch.seqs):
            sp = spans[i]
            n = len(s.token_ids)
            if s.sampler is not None and s.draft_token_ids:
                k = len(s.draft_token_ids)
                r = [sp[j] for j in range(n - k - 1, n)]
                host = logits[r].cpu().numpy()
                outs[i].token_ids = verify_drafts(host, s.sampler, s.draft_token_ids, s.draft_probs)
                if s.num_logprobs is not None:
                    outs[i].logprobs = token_logprobs(
                        logits[r[: len(outs[i].token_ids)]], outs[i].token_ids, s.num_logprobs
                    )
            if s.return_logits:  # (a prompt-end hit's one row is row -1)
                outs[i].logits = logits[[sp[j] for j in (range(n) if n else [-1])]].cpu().numpy()
        rows = [i for i, _ in plain]
        return PendingSamples(outs, rows, toks if plain else None, self._pins.next(), ring)

    def _from_cache(self, batch: ModelInput, hits: list[int]):
        """Prompt-end hits: copy their tail blocks and compute their logits [H, V] from the saved
        hidden states, before anything of this step writes a block or a slot. One hit (the usual
        case) replays the head graph: the copy, the head and the logits' argmax in one launch,
        its inputs (slot, src, dst) one upload. Else the argmax is None."""
        seqs = [batch.seqs[i] for i in hits]
        if len(seqs) == 1 and ("head", 1) in self.graphs:
            if self.hit_staged is not None:
                self.hit_staged.synchronize()  # the last hit's upload has left h_hit
            self.h_hit_np[:] = (seqs[0].cached_hidden, *(seqs[0].copy_block or (-1, -1)))
            self.g_hit.copy_(self.h_hit, non_blocking=True)
            if self.hit_staged is not None:
                self.hit_staged.record()
            self.graphs["head", 1].replay()
            return self.graph_out["head", 1]
        for s in seqs:
            if s.copy_block is not None:
                kv_cache.copy_block(self._kv_stores, upload(np.array(s.copy_block), self.device))
        slots = [s.cached_hidden for s in seqs]
        return self.model.compute_logits(self.end_hidden[self._index(slots)]), None

    def _index(self, rows: list[int]) -> torch.Tensor:
        return upload(np.asarray(rows, dtype=np.int64), self.device)

    def _last_in_place(self) -> bool:
        """Whether _last_tokens is g_last's prefix (always, with graphs, after a sampling step)."""
        t = self._last_tokens
        return t is not None and t.data_ptr() == self.g_last.data_ptr()

    def _fill_pending(self, ids: torch.Tensor, pending) -> None:
        """Write the previous step's samples, still on the device, over the PENDING ids."""
        if pending is None:
            return
        dst, src = pending
        if in_order(pending):
            ids[: len(dst)].copy_(self._last_tokens[: len(dst)])
        else:
            ids[self._index(dst)] = self._last_tokens[self._index(src)]

    # -- CUDA graphs ----------------------------------------------------------------------------

    def capture(self) -> None:
        """Capture the hit head, the prefill buckets and the decode sizes (largest first)."""
        dev, n = self.device, self.max_num_seqs
        params = self.model.config.num_params() / self.model.tp_size
        self.prefill_tokens = prefill_buckets(params, self.max_model_len)
        top, small = (self.prefill_tokens or [1])[-1], PREFILL_GRAPH_TOKENS[-1]
        pin = dev.type == "cuda"  # (CPU only in tests that stand in for the graphs)
        self.inputs = GraphInputs(max(n, min(top, small)), n, self.max_blocks, dev)
        self.g_in, self.g_ctx, self.g_bt = self.inputs.g_in, self.inputs.g_ctx, self.inputs.g_bt
        # the large prefill buckets stage one sequence in a buffer of their own
        self.large_inputs = GraphInputs(top, 1, self.max_blocks, dev) if top > small else None
        self.g_cu: dict[int, torch.Tensor] = {}
        self.graph_bs = graph_batch_sizes(n)
        pool = None
        # One pool: a graph's replay may overwrite the outputs of graphs captured after it (they
        # may sit in what its capture freed). A hit's head logits are read after the step's
        # prefill or decode replay, so the head is captured first.
        keys = []
        if self.model.tp_size == 1:  # a prompt-end hit's vocabulary head
            # (slot, src, dst) of a hit; src -1 copies nothing (the warm-up and capture)
            self.h_hit = torch.tensor([0, -1, -1], dtype=torch.int64)
            self.h_hit = self.h_hit.pin_memory() if pin else self.h_hit
            self.h_hit_np, self.g_hit = self.h_hit.numpy(), self.h_hit.to(dev)
            self.hit_staged = torch.cuda.Event() if pin else None
            keys.append(("head", 1))
        keys += [("prefill", t) for t in reversed(self.prefill_tokens)]
        keys += [("decode", b) for b in reversed(self.graph_bs)]
        with torch.inference_mode():
            for key in keys:
                # Warm-up inputs that read only block 0 and write nothing: one context position
                # a decode row, `size` positions for the prefill sequence.
                st = self._staging(*key)
                st.g_in[POS].zero_()
                st.g_ctx.fill_(1 if key[0] == "decode" else key[1])
                if key[0] == "prefill":
                    st.g_in[POS, : key[1]] = torch.arange(key[1], device=dev)
                fn = self._graph_fn(*key)
                fn()  # warm-up: compiles kernels and allocates split-K buffers outside capture
                g, self.graph_out[key] = self._capture(fn, pool)
                pool = g.pool() if pool is None else pool
                self.graphs[key] = g
        self.resident.reset()

    def _staging(self, kind: str, size: int) -> GraphInputs:
        """The staged inputs a graph reads: the large prefill buckets' own, else the shared."""
        large = kind == "prefill" and size > PREFILL_GRAPH_TOKENS[-1]
        return self.large_inputs if large else self.inputs

    def _capture(self, fn, pool):
        """(graph, its output tensor) for fn, captured into the shared pool."""
        torch.cuda.synchronize(self.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = fn()
        torch.cuda.synchronize(self.device)
        return g, out

    def _graph_fn(self, kind: str, size: int):
        """What a graph runs, reading only the staged device inputs: decode of `size` sequences
        (-> hidden, logits [size, V]), or one sequence's prefill of `size` tokens (-> hidden)."""
        g = self.g_in
        if kind == "head":

            def head():
                kv_cache.copy_block(self._kv_stores, self.g_hit[1:])
                logits = self.model.compute_logits(self.end_hidden.index_select(0, self.g_hit[:1]))
                return logits, logits.argmax(dim=-1)

            return head
        if kind == "decode":

            def run():
                meta = AttentionMetadata(
                    g[SLOT, :size],
                    self.g_bt[:size],
                    self.g_ctx[:size],
                    is_decode=True,
                    max_context_len=self.max_model_len,
                )
                last = self.g_last[:size]
                ids, take_last = g[IDS, :size], (g[FROM, :size], last)
                h = self.model(ids, g[POS, :size], self.kv_caches, meta, take_last)
                logits = self.model.compute_logits(h, top=last)  # the next PENDING ids, in place
                self.resident.advance(g, self.g_ctx, self.g_bt, last)  # tokens out, inputs on
                return h, logits, last

            return run
        # Kept on self: a graph holds raw addresses, so its constant inputs must outlive it.
        cu = self.g_cu[size] = torch.tensor([0, size], dtype=torch.int32, device=self.device)
        st = self._staging(kind, size)
        g = st.g_in

        def run():
            meta = AttentionMetadata(
                g[SLOT, :size],
                st.g_bt[:1],
                st.g_ctx[:1],
                is_decode=False,
                cu_seqlens_q=cu,
                max_q_len=size,
                max_context_len=self.max_model_len,
            )
            return self.model(g[IDS, :size], g[POS, :size], self.kv_caches, meta)

        return run

    def _replay(self, key: tuple[str, int], pending, ids, positions, slots, bt, ctx):
        """Stage the batch's rows (tokens of one prefill, or decode sequences; `pending` as
        _pending gives it), pad to the graph's size and replay it; returns its output buffer."""
        kind, size = key
        n = len(ids)
        steady = kind == "decode" and self._steady(pending, n)
        if self.resident.matches(key, steady, positions, ctx, bt):
            return self._replay_graph(key, steady, positions, ctx, bt)  # inputs on the device
        st = self._staging(kind, size)
        st.wait()
        h, c = st.h_in_np, st.h_ctx_np
        h[IDS, :n], h[POS, :n], h[SLOT, :n] = ids, positions, slots
        h[IDS, n:size], h[SLOT, n:size] = 0, -1  # padding writes no KV
        if kind == "decode":
            h[POS, n:size], h[FROM, :size], c[:n], c[n:size] = 0, 0, ctx, 1
            b = n
            # The steady state reads g_last in the graph (it holds _last_tokens, see
            # execute_async); any other pattern is filled below, before the graph rewrites it.
            if pending is not None and in_order(pending) and self._last_in_place():
                h[FROM, : len(pending[0])] = 1
                pending = None
        else:  # padded queries follow the real ones; the sequence "has" size new tokens
            h[POS, n:size] = positions[-1]
            c[0] = int(ctx[0]) - n + size
            b = 1
        st.h_bt_np[:b, : bt.shape[1]] = bt
        st.upload(b)
        self._fill_pending(st.g_in[IDS], pending)
        return self._replay_graph(key, steady, positions, ctx, bt)

    def _steady(self, pending, n: int) -> bool:
        """Every row's PENDING id is g_last's same row: the decode graph takes them itself."""
        ok = pending is not None and len(pending[0]) == n and in_order(pending)
        return ok and self._last_in_place()

    def _replay_graph(self, key, steady: bool, positions, ctx, bt) -> torch.Tensor:
        self.graphs[key].replay()
        if key[0] == "decode":
            self._published = self.resident.replayed(key, steady, positions, ctx, bt)
        else:  # a prefill bucket wrote the staged inputs the decode graphs share
            self.resident.forget()
        return self.graph_out[key]
