"""Engine counters: steps, tokens run through the model, tokens generated, finish reasons."""

from __future__ import annotations

from dataclasses import dataclass, field

from kipp_core.backend import ModelInput


@dataclass
class EngineCounters:
    steps: int = 0
    tokens_computed: int = 0  # tokens run through the model (prefill, decode and drafts)
    generation_tokens: int = 0
    requests_finished: dict = field(default_factory=dict)  # finish_reason -> count
    busy_seconds: float = 0.0

    def record_step(self, batch: ModelInput, seconds: float) -> None:
        self.steps += 1
        self.busy_seconds += seconds
        self.tokens_computed += batch.num_tokens

    def record_finished(self, req) -> None:
        for st in req.states:
            r = st.seq.finish_reason or "abort"
            self.requests_finished[r] = self.requests_finished.get(r, 0) + 1
            self.generation_tokens += len(st.seq.output_token_ids)

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "tokens_computed": self.tokens_computed,
            "generation_tokens": self.generation_tokens,
            "requests_finished": dict(self.requests_finished),
        }


def engine_metrics(engine) -> dict:
    """An LLMEngine's gauges and counters now (the server's /metrics and stats)."""
    bm, sched = engine.block_manager, engine.scheduler
    return {
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "kv_blocks_used": bm.num_used_blocks,
        "kv_blocks_free": bm.num_free_blocks,
        "kv_blocks_total": bm.num_blocks,
        "prefix_cache_hit_tokens": bm.hit_tokens,
        "prefix_cache_query_tokens": bm.query_tokens,
        "num_preemptions": sched.num_preemptions,
        **engine.stats.as_dict(),
    }
