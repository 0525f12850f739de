"""A sequence: one prompt plus the tokens generated for it, and where its KV lives."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kipp_core.backend import PENDING
from kipp_core.sampling import SamplingParams, TokenLogprob


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    stream: int = 0  # child index for n > 1
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache
    # Sampled on the device by a step still in flight, not yet appended (async scheduling).
    num_pending: int = 0
    block_table: list[int] = field(default_factory=list)
    # A prompt-end hit (kipp_core.prompt_end), until its step is built: (hidden slot, tail block
    # to copy or None, the copy's target)
    cached_end: tuple[int, int | None, int | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_preemptions: int = 0
    # timings (time.monotonic())
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding bookkeeping
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_enabled: bool = True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, the pending ones included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """The known tokens (a pending one is not known yet)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        p, o = self.prompt_token_ids, self.output_token_ids
        if i < len(p):
            return p[i]
        return o[i - len(p)] if i - len(p) < len(o) else PENDING

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None
