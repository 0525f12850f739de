"""Reading a request body: JSON only, within the body timeout, a bad Content-Encoding a 400, and
an `Expect: 100-continue` over the size limit answered 413 before the body is sent."""

from __future__ import annotations

import asyncio

from aiohttp import web

from kipp_core.server.context import STATE
from kipp_core.server.errors import APIError, bad_request


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes")


async def expect_continue(request: web.Request) -> web.Response | None:
    """aiohttp's Expect handler, but a declared length over the limit is refused at once."""
    limit = request.app[STATE].config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        response = _too_large(limit).response(request.path)
        response.force_close()
        return response
    if request.headers.get("Expect", "").lower() != "100-continue":
        raise APIError(417, f"unknown Expect: {request.headers['Expect']}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0
    return None


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object (400, 408, 413 or 415 otherwise), parsed off the event loop."""
    state = request.app[STATE]
    kind = request.content_type
    if kind != "application/json":
        raise APIError(
            415,
            f"the request body must be JSON, sent as 'Content-Type: application/json' "
            f"(got {kind!r})",
            code="unsupported_media_type",
        )
    try:
        raw = await asyncio.wait_for(request.read(), state.config.body_timeout or None)
    except asyncio.TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {state.config.body_timeout:g} s"
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(state.config.max_body_bytes) from None
    except web.HTTPException:
        raise
    except Exception as e:  # a Content-Encoding that does not decode (zlib, brotli errors)
        raise bad_request(
            f"the request body could not be decoded ({request.headers.get('Content-Encoding')}):"
            f" {type(e).__name__}"
        ) from None
    ctx = state.ready()
    return await asyncio.get_running_loop().run_in_executor(
        None, ctx.offload.parse_json, raw, ctx.max_model_len, ctx.bytes_per_token
    )
