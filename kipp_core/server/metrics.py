"""Prometheus metrics for /metrics: request counts by status, latency histograms and token
counters recorded by the server, and engine gauges read from the worker's latest snapshot."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kipp_core.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class ServerMetrics:
    """One registry per server, so several servers can live in one process (tests)."""

    def __init__(self, engine_stats: Callable[[], dict | None]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "kipp_requests",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "kipp_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kipp_queue_wait_seconds",
            "Arrival to first scheduled step",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kipp_request_latency_seconds",
            "Arrival to finish, per engine request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("kipp_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("kipp_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "kipp_request_finished",
            "Engine requests by finish reason",
            ["finish_reason"],
            registry=r,
        )
        r.register(_EngineCollector(engine_stats))

    def observe(self, out: RequestOutput) -> None:
        """Record one finished engine request."""
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.queue_wait is not None:
            self.queue_wait.observe(m.queue_wait)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_output_tokens)
        for c in out.outputs:
            self.finished.labels(c.finish_reason or "abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Gauges from the engine worker's latest `LLMEngine.metrics()` snapshot."""

    def __init__(self, stats: Callable[[], dict | None]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        loaded = GaugeMetricFamily("kipp_model_loaded", "1 once the model is loaded")
        loaded.add_metric([], 0.0 if s is None else 1.0)
        yield loaded
        if s is None:
            return
        gauges = {
            "kipp_num_requests_running": ("Sequences running", s["num_running"]),
            "kipp_num_requests_waiting": ("Sequences waiting", s["num_waiting"]),
            "kipp_kv_blocks_used": ("KV blocks in use", s["kv_blocks_used"]),
            "kipp_kv_blocks_total": ("KV blocks in the pool", s["kv_blocks_total"]),
            "kipp_kv_cache_usage_ratio": (
                "Fraction of KV blocks in use",
                s["kv_blocks_used"] / max(1, s["kv_blocks_total"]),
            ),
            "kipp_prefix_cache_hit_rate": (
                "Prompt tokens served by the prefix cache / prompt tokens admitted",
                s["prefix_cache_hit_tokens"] / max(1, s["prefix_cache_query_tokens"]),
            ),
        }
        for name, (doc, value) in gauges.items():
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        counters = {
            "kipp_prefix_cache_hit_tokens": ("Prompt tokens hit", s["prefix_cache_hit_tokens"]),
            "kipp_prefix_cache_query_tokens": (
                "Prompt tokens looked up",
                s["prefix_cache_query_tokens"],
            ),
            "kipp_preemptions": ("Sequences preempted", s["num_preemptions"]),
            "kipp_engine_steps": ("Engine steps", s["steps"]),
        }
        for name, (doc, value) in counters.items():
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c
