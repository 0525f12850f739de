"""A scheduled sequence's SeqInput for the backend: its new tokens (and drafts), block table, the
prompt tokens it scores for prompt logprobs, and when it samples, its SamplerState with the masks
of its structured output and thinking budget."""

from __future__ import annotations

import time

from kipp_core.backend import SeqInput
from kipp_core.block_manager import BlockManager
from kipp_core.request import Request
from kipp_core.sampling import SamplerState
from kipp_core.scheduler import ScheduledSeq
from kipp_core.structured_output_manager import StructuredOutputManager


def seq_input(
    s: ScheduledSeq,
    req: Request,
    drafts: dict | None,
    structured: StructuredOutputManager,
    block_manager: BlockManager,
) -> SeqInput:
    """`drafts`: seq_id -> (draft tokens, draft probs) from the draft model, or None."""
    seq = s.seq
    start = seq.num_computed_tokens
    n_real = s.num_new_tokens - len(s.draft_token_ids)
    tokens = [seq.token_at(i) for i in range(start, start + n_real)] + s.draft_token_ids
    inp = SeqInput(seq.seq_id, tokens, start, list(seq.block_table))
    if seq.cached_end is not None:  # a prompt-end hit: no tokens, the saved hidden state
        inp.cached_hidden, src, dst = seq.cached_end
        inp.copy_block = None if src is None else (src, dst)
        seq.cached_end = None
    if seq.first_scheduled_time is None:
        seq.first_scheduled_time = time.monotonic()
    p = seq.params
    # Prompt logprobs: row j (position start + j) predicts the prompt token at start + j + 1.
    if p.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
        end = min(start + n_real + 1, seq.num_prompt_tokens)
        if end > start + 1:
            inp.score_targets = seq.prompt_token_ids[start + 1 : end]
            inp.num_score_logprobs = p.prompt_logprobs
    if s.samples and not req.score_only:
        inp.sampler = SamplerState(
            p,
            seq.seed,
            seq.stream,
            seq.prompt_token_ids,
            seq.output_token_ids,
            req.states[seq.stream].stop_ids,
            seq.num_pending,
        )
        if p.structured_outputs is not None:
            inp.sampler.allowed = structured.mask(seq, inp.sampler.stop_token_ids)
        thought = req.states[seq.stream].thought
        if thought is not None:  # a spent thinking budget forces the closing tokens
            inp.sampler.allowed = thought.mask(seq.output_token_ids, inp.sampler.allowed)
        inp.num_logprobs = p.logprobs
        if start + n_real == seq.num_prompt_tokens and not seq.output_token_ids and n_real:
            inp.save_hidden = block_manager.reserve_end(seq, seq.num_prompt_tokens)
        if s.draft_token_ids:
            inp.draft_token_ids = list(s.draft_token_ids)
            inp.draft_probs = drafts[seq.seq_id][1]
    return inp
