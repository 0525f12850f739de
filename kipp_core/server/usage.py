"""What a response accounts for: OpenAI `usage`, and llama.cpp-style `timings`."""

from __future__ import annotations

from kipp_core.outputs import RequestOutput


def usage(finals: list[RequestOutput]) -> dict:
    """Prompt tokens count once per prompt (not per choice); cached ones are the prefix hits.
    Counted from the final outputs' metrics, so a stream's last delta is enough."""
    prompt = sum(o.metrics.num_prompt_tokens for o in finals)
    completion = sum(o.metrics.num_output_tokens for o in finals)
    cached = sum(o.metrics.num_cached_tokens for o in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _ms(a: float | None, b: float | None) -> float:
    return 0.0 if a is None or b is None else max(0.0, (b - a) * 1000.0)


def _rate(n: int, ms: float) -> tuple[float, float]:
    """(milliseconds per token, tokens per second); zeros when there is nothing to divide."""
    if n <= 0 or ms <= 0:
        return 0.0, 0.0
    return ms / n, 1000.0 * n / ms


def timings(finals: list[RequestOutput]) -> dict:
    """llama.cpp's `timings` object over the request's engine requests, plus `ttft_ms`.

    prompt_n / prompt_ms: prompt tokens computed (prefix-cache hits excluded, as `cache_n`) and
    the time from first scheduled to first token; predicted_n / predicted_ms: tokens generated and
    the time from first token to finish; ttft_ms: arrival to first token.
    """
    ms = [o.metrics for o in finals]
    if not ms:
        return {}
    arrival = min(m.arrival_time for m in ms)
    scheduled = min(
        (m.first_scheduled_time for m in ms if m.first_scheduled_time is not None), default=None
    )
    firsts = [m.first_token_time for m in ms if m.first_token_time is not None]
    finished = max((m.finished_time for m in ms if m.finished_time is not None), default=None)
    cache_n = sum(m.num_cached_tokens for m in ms)
    prompt_n = sum(m.num_prompt_tokens for m in ms) - cache_n
    predicted_n = sum(m.num_output_tokens for m in ms)
    # A scoring request (max_tokens 0) has no first token: its prefill runs until it finishes.
    prompt_ms = _ms(scheduled, max(firsts) if firsts else finished)
    predicted_ms = _ms(min(firsts), finished) if firsts else 0.0
    prompt_per_token, prompt_per_second = _rate(prompt_n, prompt_ms)
    predicted_per_token, predicted_per_second = _rate(predicted_n, predicted_ms)
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_per_token,
        "prompt_per_second": prompt_per_second,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_per_token,
        "predicted_per_second": predicted_per_second,
        "ttft_ms": _ms(arrival, min(firsts)) if firsts else 0.0,
    }
