"""aiohttp's own answers made the server's: a malformed request (a bad request line, headers
too large) gets an OpenAI error body instead of text/plain that echoes the request bytes, and
is logged at debug level without a traceback (a flood of them must not flood the log); the
`Server` header names no versions."""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web, web_protocol, web_server

from kipp_core.server.errors import APIError

SERVER_HEADER = "kipp"
log = logging.getLogger("kipp")


class _RequestHandler(web_protocol.RequestHandler):
    def handle_error(self, request, status: int = 500, exc=None, message=None):
        log.debug("malformed request from %s: %s", request.remote, exc)
        if request.writer.output_size > 0:
            raise ConnectionError("the response has started; cannot send an error")
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
        text = "malformed HTTP request" if status < 500 else "internal server error"
        response = APIError(status, f"{text} ({status} {phrase})".strip()).response()
        response.headers["Server"] = SERVER_HEADER
        response.force_close()
        return response


class _Server(web_server.Server):
    def __call__(self) -> web_protocol.RequestHandler:
        return _RequestHandler(self, loop=self._loop, **self._kwargs)


def use_kipp_handlers(runner: web.AppRunner) -> None:
    """After runner.setup(): connections get the handler above."""
    runner.server.__class__ = _Server


async def no_versions(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: aiohttp would send `Server: Python/3.x aiohttp/3.y`."""
    response.headers["Server"] = SERVER_HEADER
