"""The access log: one line a request on the `kipp.access` logger (off with --no-access-log).

    127.0.0.1 "POST /v1/completions" 200 id=cmpl-3f2a... prompt_tokens=12 output_tokens=16
        ttft_ms=41.2 duration_ms=187.5

TTFT is from arrival to the first generated token ("-" for none); tokens count every choice.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

ACCESS = web.RequestKey("kipp_access", str)  # the response's id, set by its handler
STREAM = web.RequestKey("kipp_stream", object)  # its RequestStream, once submitted

log = logging.getLogger("kipp.access")


def log_request(request: web.Request, status: int, started: float) -> None:
    stream = request.get(STREAM)
    ms = list(stream.metrics.values()) if stream is not None else []
    firsts = [m.first_token_time for m in ms if m.first_token_time is not None]
    ttft = "-"
    if firsts:
        ttft = f"{(min(firsts) - min(m.arrival_time for m in ms)) * 1e3:.1f}"
    log.info(
        '%s "%s %s" %d id=%s prompt_tokens=%d output_tokens=%d ttft_ms=%s duration_ms=%.1f',
        request.remote or "-",
        request.method,
        request.path,
        status,
        request.get(ACCESS, "-"),
        sum(m.num_prompt_tokens for m in ms),
        sum(m.num_output_tokens for m in ms),
        ttft,
        (time.monotonic() - started) * 1e3,
    )
