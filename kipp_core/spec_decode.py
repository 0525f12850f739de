"""Speculative decoding: proposers (prompt lookup, draft model), verification, and an adaptive gate.

Verification is the standard rejection sampler (Leviathan et al. 2023): draft token d at row i is
accepted with probability min(1, p(d) / q(d)); on rejection the next token is drawn from
norm(max(p - q, 0)); if all k drafts pass, one more token comes from row k. Greedy requests accept
while the target's argmax equals the draft, so their output is token-identical to plain decoding.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from kipp_core.backend import ModelInput, SeqInput
from kipp_core.block_manager import BlockManager
from kipp_core.sampling import SamplerState, probs, sample, uniform
from kipp_core.sequence import SeqStatus, Sequence

log = logging.getLogger("kipp")

SALT_ACCEPT, SALT_RESIDUAL, SALT_DRAFT = 1, 2, 3


def verify_drafts(
    rows: np.ndarray, st: SamplerState, drafts: list[int], draft_probs: np.ndarray | None
) -> list[int]:
    """rows: [k+1, vocab] target logits; row i predicts the token after drafts[:i].
    draft_probs: [k, vocab] draft distributions, or None for a deterministic proposer (one-hot)."""
    hist = list(st.output_token_ids)
    out: list[int] = []
    for i, d in enumerate(drafts):
        sti = dataclasses.replace(st, output_token_ids=hist)
        if st.params.is_greedy:
            t = sample(rows[i], sti)
            out.append(t)
            if t != d:
                return out
            hist = hist + [d]
            continue
        p = probs(rows[i], sti)
        q_d = 1.0 if draft_probs is None else float(draft_probs[i][d])
        u = float(uniform(st.seed, st.stream, len(hist), 1, SALT_ACCEPT)[0])
        if q_d > 0 and u * q_d <= p[d]:
            out.append(d)
            hist = hist + [d]
            continue
        if draft_probs is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - draft_probs[i], 0.0)
        if residual.sum() <= 0:
            residual = p
        out.append(draw(residual, st.seed, st.stream, len(hist), SALT_RESIDUAL))
        return out
    out.append(sample(rows[len(drafts)], dataclasses.replace(st, output_token_ids=hist)))
    return out


def draw(p: np.ndarray, seed: int, stream: int, step: int, salt: int) -> int:
    """One draw from an unnormalized distribution by the exponential race (Gumbel-max)."""
    u = uniform(seed, stream, step, p.shape[0], salt)
    with np.errstate(divide="ignore"):
        score = np.log(p.astype(np.float32)) - np.log(-np.log(u))
    return int(np.argmax(score))


@dataclass
class SpecConfig:
    method: str = "ngram"  # "ngram" | "draft"
    num_speculative_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    draft_backend: object | None = None  # a Backend for method="draft"
    # The gate: after `gate_window` proposed tokens, a request whose acceptance rate is below
    # `min_acceptance` decodes plainly from then on.
    gate_window: int = 16
    min_acceptance: float = 0.25

    def validate(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}"
            )
        if self.method == "draft" and self.draft_backend is None:
            raise ValueError("speculative method 'draft' needs a draft model")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )


def ngram_propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens, copy what follows."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        tail = tokens[L - n :]
        for start in range(L - n - 1, -1, -1):
            if tokens[start : start + n] == tail:
                return tokens[start + n : start + n + k]
    return []


class SpecDecoder:
    def __init__(self, config: SpecConfig, engine):
        config.validate()
        self.config = config
        self.engine = engine
        self.proposed = 0
        self.accepted = 0
        self.draft = DraftRunner(config.draft_backend) if config.method == "draft" else None

    def propose(self, running: list[Sequence]) -> dict[int, tuple[list[int], np.ndarray | None]]:
        """Drafts for running sequences that are decoding (one uncomputed token) and gated on."""
        k = self.config.num_speculative_tokens
        cands = [
            s
            for s in running
            if s.status is SeqStatus.RUNNING
            and s.spec_enabled
            and s.num_uncomputed == 1
            and self._room(s) > 0
        ]
        if not cands:
            return {}
        if self.draft is not None:
            return self.draft.propose(
                cands, {s.seq_id: min(k, self._room(s)) for s in cands}, self.engine.stop_ids
            )
        out = {}
        for s in cands:
            d = ngram_propose(
                s.token_ids, min(k, self._room(s)), self.config.ngram_max, self.config.ngram_min
            )
            if d:
                out[s.seq_id] = (d, None)
        return out

    def _room(self, s: Sequence) -> int:
        """Drafts must leave room for the bonus token within max_tokens, the context and a
        thinking budget (no drafts while its closing is forced)."""
        room = self.engine.max_model_len - s.num_tokens - 1
        if s.params.max_tokens is not None:
            room = min(room, s.params.max_tokens - len(s.output_token_ids) - 1)
        thought = self.engine.thought(s)
        left = None if thought is None else thought.room(s.output_token_ids)
        return room if left is None else min(room, left)

    def record(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        seq.spec_proposed += num_proposed
        seq.spec_accepted += num_accepted
        self.proposed += num_proposed
        self.accepted += num_accepted
        c = self.config
        if (
            seq.spec_proposed >= c.gate_window
            and seq.spec_accepted < c.min_acceptance * seq.spec_proposed
        ):
            seq.spec_enabled = False
            log.debug(
                "speculation off for %s: %d of %d drafts accepted",
                seq.request_id,
                seq.spec_accepted,
                seq.spec_proposed,
            )

    def release(self, seq: Sequence) -> None:
        if self.draft is not None:
            self.draft.release(seq.seq_id)


class DraftRunner:
    """A smaller model with the same tokenizer and its own paged KV, kept in step with each seq."""

    def __init__(self, backend):
        self.backend = backend
        self.bm = BlockManager(backend.num_blocks, backend.block_size, enable_prefix_caching=False)
        self.mirror: dict[int, Sequence] = {}

    def propose(self, seqs: list[Sequence], ks: dict[int, int], stop_ids):
        for s in seqs:
            m = self.mirror.get(s.seq_id)
            if m is None:
                m = self.mirror[s.seq_id] = Sequence(s.seq_id, s.request_id, [], s.params, s.seed)
            # Target rolled back rejected drafts: forget draft KV beyond what the target kept.
            m.num_computed_tokens = min(m.num_computed_tokens, s.num_computed_tokens)
        drafts = {s.seq_id: ([], []) for s in seqs}
        live = list(seqs)
        for _ in range(max(ks.values())):
            inputs, owners = [], []
            for s in live:
                m = self.mirror[s.seq_id]
                toks = s.token_ids + drafts[s.seq_id][0]
                new = toks[m.num_computed_tokens :]
                if not self.bm.allocate(m, len(toks)):
                    continue
                p = s.params
                st = SamplerState(
                    p,
                    s.seed,
                    s.stream,
                    s.prompt_token_ids,
                    s.output_token_ids + drafts[s.seq_id][0],
                    stop_ids(p),
                )
                inputs.append(
                    SeqInput(
                        s.seq_id,
                        new,
                        m.num_computed_tokens,
                        list(m.block_table),
                        return_logits=True,
                        sampler=None,
                    )
                )
                owners.append((s, m, st, len(toks)))
            if not inputs:
                break
            outs = self.backend.execute(ModelInput(inputs))
            nxt = []
            for (s, m, st, n), o in zip(owners, outs):
                m.num_computed_tokens = n
                q = probs(o.logits[-1], st)
                if st.params.is_greedy:
                    t = int(np.argmax(q))
                else:
                    t = draw(q, st.seed ^ 0x5EED, st.stream, len(st.output_token_ids), SALT_DRAFT)
                drafts[s.seq_id][0].append(t)
                drafts[s.seq_id][1].append(q)
                if len(drafts[s.seq_id][0]) < ks[s.seq_id]:
                    nxt.append(s)
            live = nxt
        return {sid: (d, np.stack(q)) for sid, (d, q) in drafts.items() if d}

    def release(self, seq_id: int) -> None:
        m = self.mirror.pop(seq_id, None)
        if m is not None:
            self.bm.free(m)
