"""The engine loop: admit requests, schedule a step, run it on the backend, turn tokens into text.

    scheduled = scheduler.schedule()
    outputs = backend.execute(model_input(scheduled))
    postprocess(scheduled, outputs)

With a backend that offers `execute_async` (async scheduling, as vLLM's), a step queues step N+1
on the device before it waits for step N: N+1's decodes take N's samples as PENDING tokens, which
the backend reads on the device, so the host's scheduling and detokenizing overlap the GPU. Each
sequence is advanced at launch (computed tokens, one pending sample); its sample is appended when
the result arrives. A sequence whose next step depends on the pending token's value (penalties,
a structured-outputs mask) or that is sure to finish waits instead. Outputs equal the synchronous
loop's, token for token.

Structured outputs (structured_output_manager.py): a constrained request joins the scheduler once
its constraint is made, off this thread; its steps carry their masks (SamplerState.allowed). A
thinking budget (thinking_budget.py) forces the thought's closing tokens by the same masks.

Single-threaded: the server drives it from one worker thread (kipp_core.server.async_engine).
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from kipp_core.backend import Backend, ModelInput, SeqInput, SeqOutput
from kipp_core.block_manager import BlockManager
from kipp_core.model_input import seq_input
from kipp_core.outputs import RequestMetrics, RequestOutput
from kipp_core.quarantine import Quarantine
from kipp_core.request import (
    Request,
    SeqState,
    TokenDelta,
    take_output,
    take_token_delta,
    validate_prompt,
)
from kipp_core.sampling import SamplingParams, stop_token_set
from kipp_core.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from kipp_core.sequence import SeqStatus, Sequence
from kipp_core.stats import EngineCounters, engine_metrics
from kipp_core.stop import StopMatcher
from kipp_core.structured_output_manager import StructuredOutputManager
from kipp_core.thinking_budget import ThinkTokens, Thought
from kipp_core.tokenizer import Tokenizer

log = logging.getLogger("kipp")


@dataclass
class EngineConfig:
    max_model_len: int | None = None  # defaults to the model's context length
    enable_prefix_caching: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: object | None = None  # a kipp_core.spec_decode.SpecConfig
    async_scheduling: bool = True  # where the backend offers execute_async (not with speculation)


class LLMEngine:
    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        stop_token_ids: tuple[int, ...],
        config: EngineConfig | None = None,
    ):
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_config = backend.config
        self.config = config or EngineConfig()
        self.eos_token_ids = tuple(stop_token_ids)
        ctx = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or ctx, ctx)
        # Prompt-end hits skip the forward pass, which speculation's draft model does not.
        slots = 0 if self.config.speculative else getattr(backend, "num_hidden_slots", 0)
        self.block_manager = BlockManager(
            backend.num_blocks, backend.block_size, self.config.enable_prefix_caching, slots
        )
        capacity = backend.num_blocks * backend.block_size
        if capacity < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({backend.num_blocks} blocks of "
                f"{backend.block_size}), less than one full-context request of "
                f"{self.max_model_len} tokens; raise the KV budget or lower max_model_len"
            )
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager)
        self.scheduler.serial_seqs = bool(getattr(backend, "serial_seqs", False))
        self.requests: dict[str, Request] = {}
        self._seq_counter = 0
        self.spec = None
        if self.config.speculative is not None:
            from kipp_core.spec_decode import SpecDecoder

            self.spec = SpecDecoder(self.config.speculative, self)
        self.stats = EngineCounters()
        self.structured = StructuredOutputManager(tokenizer, self.model_config.vocab_size)
        self._think: ThinkTokens | None = None  # made at the first thinking budget
        self._async = (
            self.config.async_scheduling and self.spec is None and hasattr(backend, "execute_async")
        )
        self._inflight = None  # (scheduled, batch, PendingOutputs, launch time) of the queued step
        self.quarantine = Quarantine(self.scheduler)
        self._blame: set[str] = set()  # the requests of the step in progress (quarantine.py)

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        score_only: bool = False,
        final_only: bool = False,
        delta: bool = False,
    ) -> None:
        """Queue a request. ValueError for bad input, QueueFullError when the queue is full.
        `final_only` (vLLM's RequestOutputKind.FINAL_ONLY): step() reports it once, when done;
        `delta` (RequestOutputKind.DELTA): each output holds only what is new (request_output)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        ids = self.validate_prompt(prompt_token_ids, params)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        metrics = RequestMetrics(arrival_time or time.monotonic(), num_prompt_tokens=len(ids))
        states = []
        budget = params.thinking_token_budget
        if budget is not None and self._think is None:
            self._think = ThinkTokens(self.tokenizer, self.model_config.vocab_size)
        for i in range(params.n):
            self._seq_counter += 1
            seq = Sequence(
                self._seq_counter,
                request_id,
                list(ids),
                params,
                seed,
                stream=i,
                arrival_time=metrics.arrival_time,
            )
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            seq.spec_enabled = self.spec is not None and not score_only
            states.append(
                SeqState(
                    seq,
                    self.tokenizer.detokenizer(params.skip_special_tokens),
                    StopMatcher(params.stop_strings, params.include_stop_str_in_output),
                    stop_ids=self.stop_ids(params),
                    thought=None if budget is None else Thought(self._think, budget, ids),
                )
            )
        req = Request(
            request_id, list(ids), params, states, metrics, prompt, score_only, final_only, delta
        )
        if params.structured_outputs is not None:  # it joins the scheduler once its mask is made
            self.structured.add(req, self.spec is not None, self.scheduler)
            self.requests[request_id] = req
            return
        added = []
        try:
            for st in states:
                self.scheduler.add(st.seq)
                added.append(st.seq)
        except Exception:
            for s in added:
                self.scheduler.finish(s, "abort")
            raise
        self.requests[request_id] = req

    def validate_prompt(self, prompt_token_ids, params: SamplingParams) -> list[int]:
        return validate_prompt(
            prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. Returns False if it is unknown or done."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        for st in req.states:
            if not st.seq.is_finished:
                self._finish(st, "abort")
        self.quarantine.release(request_id)
        self.structured.release(request_id)
        return True

    def abort_all(self) -> list[str]:
        """Abort every request and forget it at once, without another step (after a step failed):
        all blocks are freed and no outputs are reported. Returns the request ids."""
        self._inflight = None
        ids = list(self.requests)
        for rid in ids:
            self.abort_request(rid)
            del self.requests[rid]
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------------------------

    def step(self, deltas: list[TokenDelta] | None = None) -> list[RequestOutput]:
        """One step; a step that raises fails only the requests it can blame (quarantine.py).
        With `deltas` (the server's streams), a plain step of a one-sequence stream goes there
        as a TokenDelta tuple instead of a RequestOutput (request.py: take_token_delta)."""
        if self.structured.num_compiling:
            idle = self._inflight is None and not self.scheduler.has_unfinished()
            for rid in self.structured.admit(self.scheduler, wait=0.005 if idle else 0.0):
                self.abort_request(rid)  # (its constraint failed to build: logged)
        solo = self.quarantine.next_solo()
        self._blame = set()
        try:
            if solo is not None:
                self.quarantine.run_alone(self, solo)
            elif self._async:
                self._step_async()
            else:
                self._step_sync()
        except Exception as exc:
            self.quarantine.recover(self, exc)
        return self._collect_outputs(deltas)

    def _step_sync(self, only: set[int] | None = None) -> None:
        drafts = self.spec.propose(self.scheduler.running) if self.spec else None
        hold = self.quarantine.holds if self.quarantine and only is None else None
        scheduled = self.scheduler.schedule(
            {k: v[0] for k, v in drafts.items()} if drafts else None, hold, only
        )
        if scheduled:
            self._blame.update(s.seq.request_id for s in scheduled)
            batch = ModelInput([self._seq_input(s, drafts) for s in scheduled])
            t0 = time.perf_counter()
            outs = self.backend.execute(batch)
            self.stats.record_step(batch, time.perf_counter() - t0)
            assert len(outs) == len(scheduled)
            now = time.monotonic()
            for s, out in zip(scheduled, outs):
                self._advance(s)
                self._postprocess(s, out, now)

    def _step_async(self) -> None:
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._blame.update(s.seq.request_id for s in prev[0])
        hold = self._hold
        if self.quarantine:
            hold = lambda seq: self.quarantine.holds(seq) or self._hold(seq)  # noqa: E731
        scheduled = self.scheduler.schedule(hold=hold)
        if scheduled:
            self._blame.update(s.seq.request_id for s in scheduled)
            batch = ModelInput([self._seq_input(s, None) for s in scheduled])
            self._inflight = (
                scheduled,
                batch,
                self.backend.execute_async(batch),
                time.perf_counter(),
            )
            for s in scheduled:
                self._advance(s)
        if prev is not None:
            self._finish_inflight(prev)

    def _finish_inflight(self, step) -> None:
        scheduled, batch, pending, t0 = step
        outs = pending.result()
        self.stats.record_step(batch, time.perf_counter() - t0)
        now = time.monotonic()
        for s, out in zip(scheduled, outs):
            self._postprocess(s, out, now)

    def _hold(self, seq: Sequence) -> bool:
        """Async scheduling: wait for seq's pending token instead of computing after it."""
        if seq.num_uncomputed == 0:
            return True  # nothing to compute until the sample arrives (score-only, held before)
        if not seq.num_pending:
            return False
        p = seq.params
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
            return True  # the next sample depends on the pending token's value
        if p.structured_outputs is not None:
            return True  # so does the next mask
        thought = self.thought(seq)
        if thought is not None and thought.may_force(seq.output_token_ids, seq.num_pending):
            return True  # the pending token may spend the thinking budget
        made = len(seq.output_token_ids) + seq.num_pending
        return (
            p.max_tokens is not None and made >= p.max_tokens
        ) or seq.num_tokens >= self.max_model_len

    def _advance(self, s: ScheduledSeq) -> None:
        """A step was queued for s: its new tokens count as computed, its sample as pending."""
        s.seq.num_computed_tokens += s.num_new_tokens - len(s.draft_token_ids)
        if s.samples:
            s.seq.num_pending += 1

    def _seq_input(self, s: ScheduledSeq, drafts) -> SeqInput:
        req = self.requests[s.seq.request_id]
        return seq_input(s, req, drafts, self.structured, self.block_manager)

    def thought(self, seq: Sequence) -> Thought | None:
        """seq's thought under its thinking budget, or None."""
        req = self.requests.get(seq.request_id)
        return None if req is None else req.states[seq.stream].thought

    def stop_ids(self, p: SamplingParams) -> tuple[int, ...]:
        return stop_token_set(p, self.eos_token_ids)

    def _postprocess(self, s: ScheduledSeq, out: SeqOutput, now: float) -> None:
        seq = s.seq
        if seq.status is not SeqStatus.RUNNING:
            return
        req = self.requests[seq.request_id]
        st = req.states[seq.stream]
        if out.scores:
            seq.prompt_logprobs.extend(out.scores)
        if not s.samples:
            self.block_manager.publish(seq)
            return
        seq.num_pending -= 1
        if req.score_only:
            self.block_manager.publish(seq)
            self._finish(st, "length")
            return
        if s.draft_token_ids and self.spec:
            self.spec.record(seq, len(s.draft_token_ids), len(out.token_ids) - 1)
        # Accepted draft tokens were computed this step too; the last sampled one was not.
        seq.num_computed_tokens += len(out.token_ids) - 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
        reason = None
        for i, tok in enumerate(out.token_ids):
            seq.output_token_ids.append(tok)
            st.delta_ids.append(tok)
            if out.logprobs is not None:
                seq.logprobs.append(out.logprobs[i])
                st.delta_logprobs.append(out.logprobs[i])
            reason = self._check_stop(st, tok)
            if reason:
                break
        self.block_manager.publish(seq)  # after the append: published blocks hold known tokens
        self.block_manager.publish_end(seq)
        if reason:
            self._finish(st, reason)

    def _check_stop(self, st: SeqState, tok: int) -> str | None:
        seq, p = st.seq, st.seq.params
        if tok in st.stop_ids and len(seq.output_token_ids) > p.min_tokens:
            seq.stop_reason = tok if tok in (p.stop_token_ids or ()) else None
            return "stop"
        emitted, stopped = st.stop.feed(st.detok.add(tok))
        st.text += emitted
        st.delta_text += emitted
        if stopped:
            seq.stop_reason = st.stop.matched
            return "stop"
        if p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens:
            return "length"
        if seq.num_known_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, st: SeqState, reason: str) -> None:
        seq = st.seq
        if reason != "abort" and not st.stop.stopped:
            tail = st.stop.feed(st.detok.flush())[0] + st.stop.flush()
            st.text += tail
            st.delta_text += tail
        self.scheduler.finish(seq, reason)
        if self.spec is not None:
            self.spec.release(seq)
        seq.finished_time = time.monotonic()

    def _collect_outputs(self, deltas: list[TokenDelta] | None) -> list[RequestOutput]:
        results = []
        for rid, req in list(self.requests.items()):
            if deltas is not None and (d := take_token_delta(req)) is not None:
                deltas.append(d)
                continue
            out = take_output(req)
            if out is None:
                continue
            results.append(out)
            if out.finished:
                del self.requests[rid]
                self.structured.release(rid)
                self.stats.record_finished(req)
        return results

    def metrics(self) -> dict:
        return engine_metrics(self)
