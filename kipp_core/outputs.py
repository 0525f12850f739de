"""What the engine hands back: per request, per completion, with deltas for streaming."""

from __future__ import annotations

from dataclasses import dataclass, field

from kipp_core.sampling import TokenLogprob


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # What is new since the previous RequestOutput of this request (streaming).
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprob] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(x.logprob for x in self.logprobs))


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache

    @property
    def queue_wait(self) -> float | None:
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    @property
    def ttft(self) -> float | None:
        t = self.first_token_time
        return None if t is None else t - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # the engine failed this request (it finished as "abort")

    # The first completion's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Delta outputs `a` then `b` of one request as one: texts, ids and logprobs concatenated;
    the state (finish, metrics, error) is b's. Neither input is changed."""
    outs = {c.index: c for c in a.outputs}
    for c in b.outputs:
        p = outs.get(c.index)
        if p is None:
            outs[c.index] = c
            continue
        outs[c.index] = CompletionOutput(
            index=c.index,
            text=p.text + c.text,
            token_ids=p.token_ids + c.token_ids,
            logprobs=None if c.logprobs is None else (p.logprobs or []) + c.logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            text_delta=p.text_delta + c.text_delta,
            token_ids_delta=p.token_ids_delta + c.token_ids_delta,
            logprobs_delta=p.logprobs_delta + c.logprobs_delta,
        )
    return RequestOutput(
        b.request_id,
        a.prompt_token_ids or b.prompt_token_ids,
        [outs[i] for i in sorted(outs)],
        b.finished,
        b.metrics,
        a.prompt if a.prompt is not None else b.prompt,
        a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        b.error,
    )
