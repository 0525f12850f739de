"""A run's summary, with vLLM benchmark_serving's definitions and key names.

TTFT: send to the first event that carries tokens. ITL: every gap between consecutive such
events of a request. TPOT: a request's (end-to-end - TTFT) / (output tokens - 1). Throughputs
count completed requests over the run's duration (start to the last request's end). Latencies in
milliseconds; percentiles interpolate linearly (numpy's default, as vLLM).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from kipp_core.loadgen.client import OK
from kipp_core.loadgen.runner import LoadResult

STATS = (("mean", None), ("median", 50), ("p90", 90), ("p99", 99))
METRICS = ("ttft", "tpot", "itl", "e2el")


def _stats(name: str, seconds: np.ndarray) -> dict:
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    out = {}
    for stat, q in STATS:
        v = None
        if ms.size:
            v = float(ms.mean() if q is None else np.percentile(ms, q))
        out[f"{stat}_{name}_ms"] = v
    return out


def _peak_concurrency(sent: np.ndarray, done: np.ndarray) -> int:
    if not sent.size:
        return 0
    events = np.concatenate(
        [np.stack([sent, np.ones_like(sent)], 1), np.stack([done, -np.ones_like(done)], 1)]
    )
    events = events[np.lexsort((events[:, 1], events[:, 0]))]  # an end before a start at a tie
    return int(np.cumsum(events[:, 1]).max())


def summarize(result: LoadResult, prompt_lens: list[int], max_tokens: list[int]) -> dict:
    """The run's counts, throughputs and latency statistics (None where nothing was measured).
    Token counts come from each request's usage chunk, else from its token-carrying events."""
    r = result.records
    ok = (r["status"] == OK) & np.array([e is None for e in r["error"]], dtype=bool)
    has_usage = r["output_tokens"] >= 0
    out_tok = np.where(has_usage, r["output_tokens"], r["chunks"])
    in_tok = np.where(r["prompt_tokens"] >= 0, r["prompt_tokens"], np.asarray(prompt_lens))
    ttft = r["ttft"]
    e2e = r["done"] - r["sent"]
    timed = ok & ~np.isnan(ttft)
    multi = timed & (out_tok > 1)
    tpot = (e2e[multi] - ttft[multi]) / (out_tok[multi] - 1)
    itl = r["itl"][np.isin(r["itl_owner"], r["index"][ok])]
    duration = result.duration
    n_ok = int(ok.sum())
    total_out, total_in = int(out_tok[ok].sum()), int(in_tok[ok].sum())
    errors = Counter((int(s), e) for s, e, good in zip(r["status"], r["error"], ok) if not good)
    usage_ok = has_usage[ok]
    out = {
        "num_requests": len(ok),
        "completed": n_ok,
        "errors": len(ok) - n_ok,
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": n_ok / duration if duration > 0 else None,
        "output_throughput": total_out / duration if duration > 0 else None,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else None,
        "peak_concurrency": _peak_concurrency(r["sent"], r["done"]),
        "client_busy": result.client_busy,
        # Completed requests whose output is not the requested length (with ignore_eos: none).
        "length_mismatches": int((out_tok[ok] != np.asarray(max_tokens)[ok]).sum()),
        "tokens_from": "usage"
        if usage_ok.all()
        else ("chunks" if not usage_ok.any() else "usage and chunks"),
    }
    for name, values in (("ttft", ttft[timed]), ("tpot", tpot), ("itl", itl), ("e2el", e2e[ok])):
        out.update(_stats(name, values))
    out["error_kinds"] = [
        {"status": s, "message": m, "count": c} for (s, m), c in errors.most_common(10)
    ]
    return out
