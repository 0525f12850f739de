"""FIFO scheduler with continuous batching, chunked prefill, preemption by recompute and abort.

Every step first gives each running sequence its next tokens (decodes, then unfinished prefills),
then admits waiting sequences while the token budget, `max_num_seqs` and the KV blocks allow. A long
prompt takes only what is left of the budget, so it never stalls the decodes beside it. When blocks
run out, the newest running sequence is preempted: its blocks are freed and it recomputes later.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from kipp_core.block_manager import BlockManager
from kipp_core.sequence import SeqStatus, Sequence


class QueueFullError(RuntimeError):
    """The waiting queue is full; the server answers 429."""


SERIAL_STEP_SEQS = 4  # sequences a step for one request alone on a serial backend (_share)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_waiting: int = 4096
    # Largest prefill chunk; prompts longer than this run over several steps.
    long_prefill_threshold: int | None = None

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step (including draft tokens)
    draft_token_ids: list[int]
    samples: bool = False  # the step reaches the end of the sequence: sample the next token

    def __post_init__(self):
        s = self.seq
        n_real = self.num_new_tokens - len(self.draft_token_ids)
        self.samples = s.num_computed_tokens + n_real == s.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        config.validate()
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # A backend that runs a step's sequences one after another (the oracle: a step costs
        # the sum of its sequences) shares each step equally between requests (_share), so
        # one request's n cannot slow another by more than its own share.
        self.serial_seqs = False

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(
        self,
        drafts: dict[int, list[int]] | None = None,
        hold: Callable[[Sequence], bool] | None = None,
        only: set[int] | None = None,
    ) -> list[ScheduledSeq]:
        """Pick this step's work. `drafts` maps seq_id to proposed draft tokens for decodes;
        running sequences for which `hold` is true wait this step out (async scheduling: their
        pending token must be known first). With `only`, just those seq ids run (a request
        under suspicion alone: they head the waiting queue)."""
        budget = self.config.max_num_batched_tokens
        chunk_cap = self.config.long_prefill_threshold or budget
        out: list[ScheduledSeq] = []
        scheduled: set[int] = set()
        preempted = False
        cap = self._share(hold, only) if self.serial_seqs else None
        taken: Counter[str] = Counter()
        running = list(self.running)
        if cap is not None:  # within a request, its lagging sequences first
            first: dict[str, int] = {}
            for i, s in enumerate(running):
                first.setdefault(s.request_id, i)
            running.sort(key=lambda s: (first[s.request_id], len(s.output_token_ids)))
        for seq in running:
            if seq.status is not SeqStatus.RUNNING or budget <= 0 or (hold and hold(seq)):
                continue
            if only is not None and seq.seq_id not in only:
                continue
            if cap is not None and taken[seq.request_id] >= cap:
                continue
            draft = (drafts or {}).get(seq.seq_id, []) if seq.num_uncomputed == 1 else []
            draft = draft[: max(0, budget - 1)]
            n = min(seq.num_uncomputed, budget, chunk_cap) + len(draft)
            while not self.bm.allocate(seq, seq.num_computed_tokens + n):
                victim = next(
                    (s for s in reversed(self.running) if s.seq_id not in scheduled), None
                )
                if victim is None:
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.append(ScheduledSeq(seq, n, draft))
                scheduled.add(seq.seq_id)
                taken[seq.request_id] += 1
                budget -= n
        # Admit in FIFO order; stop at the first that does not fit (no overtaking, but past a
        # request that has its share), and admit nothing in a step that had to preempt.
        for seq in list(self.waiting):
            if preempted or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if only is not None and seq.seq_id not in only:
                break
            if cap is not None and taken[seq.request_id] >= cap:
                continue
            if not seq.block_table:
                self.bm.allocate_prefix(seq)
            n = min(seq.num_uncomputed, budget, chunk_cap)
            if not self.bm.allocate(seq, seq.num_computed_tokens + n):
                if not self.running:
                    # Nothing will ever free blocks for it: the engine rejects such requests at
                    # admission, so this only happens when the pool itself is misconfigured.
                    raise RuntimeError(f"request {seq.request_id} cannot fit in the KV cache")
                self.bm.free(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            self.waiting.remove(seq)
            self.bm.count_admission(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n, []))
            scheduled.add(seq.seq_id)
            taken[seq.request_id] += 1
            budget -= n
        return out

    def _share(self, hold, only) -> int | None:
        """With serial_seqs: the sequences each request may run this step, the fewest any active
        request has (running or waiting), so that every request gets an equal share of the
        step's time; SERIAL_STEP_SEQS for one request alone."""
        if only is not None:
            return None
        counts: Counter[str] = Counter(s.request_id for s in self.running if not (hold and hold(s)))
        counts.update(s.request_id for s in self.waiting)  # a waiting one passes a full share
        if len(counts) > 1:
            return min(counts.values())
        # One request alone still runs at most SERIAL_STEP_SEQS sequences a step: a request that
        # arrives while that step runs (the server's engine thread) waits for a short step, not
        # one of its n = 128; the serial backend's time is the same either way.
        return SERIAL_STEP_SEQS if counts else None

    def _preempt(self, seq: Sequence) -> None:
        self.reset(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def reset(self, seq: Sequence) -> None:
        """Free seq's blocks and put it at the head of the waiting queue, to compute again from
        its first token (a preemption, or the suspects of a failed step)."""
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_pending = 0  # an in-flight sample is dropped; it is sampled again, the same
        if seq.wants_prompt_logprobs and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            seq.prompt_logprobs = [None]  # scored again from the first chunk
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.waiting.appendleft(seq)
        seq.status = SeqStatus.WAITING

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its blocks at once (also used for aborts)."""
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.bm.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
