"""Interim: token masks (`response_format` json_object / json_schema, a forced `tool_choice`)
without an engine hook.

The engine has no logits-mask hook yet, so this wraps the backend. For a constrained sequence that
samples this step, the backend runs its tokens without sampling (all but the last), then the last
token alone with `return_logits`; the next token is drawn by the reference sampler
(`kipp_core.sampling.sample`, with the request's seed, stream and step) from the logits with the
disallowed tokens set to -inf, and logprobs come from the unmasked logits, as the backends report
them. Unconstrained sequences go through untouched. Once the engine applies
`SamplerState.allowed_token_ids` itself, this file goes away (see the server report).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kipp_core.backend import ModelInput, SeqInput, SeqOutput
from kipp_core.sampling import logprobs, sample
from kipp_core.server.json_constraint import JsonConstraint

_NEG_INF = np.float32(-np.inf)


class ConstrainedBackend:
    def __init__(self, inner, engine):
        self.inner = inner
        self.engine = engine
        self.config = inner.config
        self.block_size = inner.block_size
        self.num_blocks = inner.num_blocks
        # request_id -> its JsonConstraint or ToolCallConstraint (an `allowed` method each)
        self.constraints: dict[str, JsonConstraint] = {}

    def __getattr__(self, name):  # anything else a caller wants from the real backend
        return getattr(self.inner, name)

    def _masks(self, batch: ModelInput) -> list[np.ndarray | None]:
        if not self.constraints:
            return [None] * len(batch.seqs)
        owner = {s.seq_id: s.request_id for s in self.engine.scheduler.running}
        masks = []
        for inp in batch.seqs:
            c = self.constraints.get(owner.get(inp.seq_id)) if inp.sampler else None
            m = None
            if c is not None:
                sp = inp.sampler
                m = c.allowed(sp.stream, sp.output_token_ids, sp.stop_token_ids)
            masks.append(m if m is not None and m.any() else None)
        return masks

    def execute(self, batch: ModelInput) -> list[SeqOutput]:
        masks = self._masks(batch)
        if all(m is None for m in masks):
            return self.inner.execute(batch)
        first, last = [], []
        for inp, m in zip(batch.seqs, masks):
            if m is None:
                first.append(inp)
                continue
            assert not inp.draft_token_ids, "constraints run without speculative decoding"
            n = len(inp.token_ids)
            if inp.cached_hidden is not None:  # a prompt-end hit: its one row of logits
                last.append(
                    dataclasses.replace(inp, sampler=None, num_logprobs=None, return_logits=True)
                )
                continue
            if n > 1:
                first.append(
                    dataclasses.replace(
                        inp,
                        token_ids=inp.token_ids[:-1],
                        sampler=None,
                        num_logprobs=None,
                        save_hidden=None,
                    )
                )
            last.append(
                SeqInput(
                    inp.seq_id,
                    inp.token_ids[-1:],
                    inp.start_pos + n - 1,
                    inp.block_table,
                    return_logits=True,
                    save_hidden=inp.save_hidden,  # the prompt's last row is this one
                )
            )
        head = iter(self.inner.execute(ModelInput(first)) if first else [])
        tail = iter(self.inner.execute(ModelInput(last)))
        outs = []
        for inp, m in zip(batch.seqs, masks):
            if m is None:
                outs.append(next(head))
                continue
            out = next(head) if len(inp.token_ids) > 1 else SeqOutput()
            raw = next(tail).logits[-1]
            tok = sample(np.where(m, raw, _NEG_INF), inp.sampler)
            out.token_ids = [tok]
            out.logits = None
            if inp.num_logprobs is not None:
                out.logprobs = [logprobs(raw, tok, inp.num_logprobs)]
            outs.append(out)
        return outs
