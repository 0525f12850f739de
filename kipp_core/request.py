"""The engine's record of one request: its sequences with their detokenizer and stop matcher,
and the RequestOutput built from them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kipp_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kipp_core.sampling import SamplingParams
from kipp_core.sequence import SeqStatus, Sequence
from kipp_core.stop import StopMatcher
from kipp_core.thinking_budget import Thought
from kipp_core.tokenizer import IncrementalDetokenizer


@dataclass
class SeqState:
    seq: Sequence
    detok: IncrementalDetokenizer
    stop: StopMatcher
    text: str = ""
    delta_text: str = ""
    delta_ids: list[int] = field(default_factory=list)
    delta_logprobs: list = field(default_factory=list)
    stop_ids: tuple[int, ...] = ()  # the token ids that end it (stop_token_set)
    thought: Thought | None = None  # under a thinking budget (kipp_core/thinking_budget.py)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    states: list[SeqState]
    metrics: RequestMetrics
    prompt: str | None = None
    score_only: bool = False
    final_only: bool = False  # report only when done (offline LLM.generate)
    delta: bool = False  # each output holds only what is new (the server's streams)
    error: str | None = None  # why the engine failed it (kipp_core/quarantine.py)
    reported: bool = False  # an output has been made (delta: the prompt went with it)


def request_output(req: Request, done: bool) -> RequestOutput:
    """The request's RequestOutput now: cumulative fields plus what is new since the last one.

    A `delta` request's outputs hold only what is new, as plain data that nothing else refers
    to: text, token_ids and logprobs are the deltas, and the prompt's ids and logprobs come with
    the first output only (merge_outputs sums them up again)."""
    if req.delta:
        return _delta_output(req, done)
    m = _metrics(req, done)
    outs = []
    for st in req.states:
        s = st.seq
        outs.append(
            CompletionOutput(
                index=s.stream,
                text=st.text,
                token_ids=list(s.output_token_ids),
                logprobs=list(s.logprobs) if s.params.logprobs is not None else None,
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
                text_delta=st.delta_text,
                token_ids_delta=list(st.delta_ids),
                logprobs_delta=list(st.delta_logprobs),
            )
        )
    plp = req.states[0].seq.prompt_logprobs if req.params.prompt_logprobs is not None else None
    return RequestOutput(
        req.request_id,
        req.prompt_token_ids,
        outs,
        done,
        m,
        req.prompt,
        list(plp) if plp is not None else None,
        req.error,
    )


def take_output(req: Request) -> RequestOutput | None:
    """The output the request reports after a step, its deltas taken; None when it has nothing
    to report (running with nothing new, or reporting only when done)."""
    states = req.states
    if len(states) == 1:  # the common case, without generators (256 a step)
        st = states[0]
        done = st.seq.status is SeqStatus.FINISHED
        news = st.delta_ids or st.delta_text
    else:
        done = all(st.seq.is_finished for st in states)
        news = any(st.delta_ids or st.delta_text for st in states)
    if not done and (req.final_only or not news):
        return None
    out = request_output(req, done)
    for st in states:
        st.delta_text, st.delta_ids, st.delta_logprobs = "", [], []
    return out


# (request_id, text, token_ids): what a plain step of a one-sequence stream adds. At 256 streams
# a step, a RequestOutput each (with its completion and metrics snapshot, packed and pickled for
# the API process) cost the engine process ~1.3 ms a step on an H200's host; the API process
# rebuilds the RequestOutput (kipp_core.server.async_engine: RequestStream.put_delta).
TokenDelta = tuple[str, str, list[int]]


def take_token_delta(req: Request) -> TokenDelta | None:
    """The step's news of a streamed one-sequence request as a TokenDelta when that is all it
    has to say: not its first output (the prompt goes with that) nor its last, no logprobs, no
    error. Else None (take_output then makes its RequestOutput)."""
    if not req.delta or not req.reported or len(req.states) != 1:
        return None
    st = req.states[0]
    if st.seq.status is SeqStatus.FINISHED or st.seq.stream or req.error is not None:
        return None
    if req.params.logprobs is not None or not (st.delta_ids or st.delta_text):
        return None
    d = (req.request_id, st.delta_text, st.delta_ids)
    st.delta_text, st.delta_ids = "", []
    return d


def _metrics(req: Request, done: bool) -> RequestMetrics:
    """A snapshot of the request's metrics (the engine goes on updating its own). It is made for
    every output of every step of a stream, so the one-sequence case skips the reductions and
    the copy is a dict update: dataclasses.replace and the reductions took ~4 us an output, 1.1
    ms of a 4.9 ms engine step of 256 streams with no model (a 2-core x86 CPU)."""
    m = req.metrics
    if len(req.states) == 1:
        s = req.states[0].seq
        m.first_scheduled_time = s.first_scheduled_time
        m.num_output_tokens = len(s.output_token_ids)
        m.num_cached_tokens = s.num_cached_tokens
        if done:
            m.finished_time = s.finished_time or time.monotonic()
    else:
        seqs = [st.seq for st in req.states]
        m.first_scheduled_time = min(
            (s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None),
            default=None,
        )
        m.num_output_tokens = sum(len(s.output_token_ids) for s in seqs)
        m.num_cached_tokens = max(s.num_cached_tokens for s in seqs)
        if done:
            m.finished_time = max(s.finished_time or time.monotonic() for s in seqs)
    snap = object.__new__(RequestMetrics)
    snap.__dict__.update(m.__dict__)
    return snap


def _delta_output(req: Request, done: bool) -> RequestOutput:
    first = not req.reported
    req.reported = True
    outs = [
        CompletionOutput(
            index=st.seq.stream,
            text=st.delta_text,
            token_ids=st.delta_ids,
            logprobs=st.delta_logprobs if req.params.logprobs is not None else None,
            finish_reason=st.seq.finish_reason,
            stop_reason=st.seq.stop_reason,
            text_delta=st.delta_text,
            token_ids_delta=st.delta_ids,
            logprobs_delta=st.delta_logprobs,
        )
        for st in req.states
    ]
    plp = req.states[0].seq.prompt_logprobs if req.params.prompt_logprobs is not None else None
    return RequestOutput(
        req.request_id,
        list(req.prompt_token_ids) if first else [],
        outs,
        done,
        _metrics(req, done),
        req.prompt if first else None,
        list(plp) if plp is not None and first else None,
        req.error,
    )


def validate_prompt(prompt_token_ids, params: SamplingParams, vocab: int, limit: int) -> list[int]:
    """The prompt as a list of ids, or a ValueError naming what is wrong with it."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("prompt is empty: at least one token is needed")
    # All good at C speed (a loop costs a prefix hit ~0.5 ms); else the loop names the bad id.
    if not (set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab):
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(
                    f"prompt token id {t!r} is outside the vocabulary (0..{vocab - 1})"
                )
    n = len(ids)
    if n >= limit:
        raise ValueError(
            f"prompt has {n} tokens, but the context holds {limit} "
            "(the prompt plus at least one generated token)"
        )
    if params.max_tokens is not None and n + params.max_tokens > limit:
        raise ValueError(
            f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is "
            f"{n + params.max_tokens}, more than the context of {limit} tokens"
        )
    return ids
