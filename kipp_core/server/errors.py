"""Error bodies: OpenAI's everywhere but under /v1/messages, where they are Anthropic's. Every
failure a client sees is one of these; never a traceback."""

from __future__ import annotations

import json

from aiohttp import web

# Error `type` by HTTP status (OpenAI's names where it has one, llama.cpp's otherwise).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "unavailable_error",
}
# Anthropic's error `type` by HTTP status
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATHS = "/v1/messages"  # and below it
_MAX_MESSAGE = 1000  # a huge bad value must not come back in full


class APIError(Exception):
    """A failure that becomes `{"error": {message, type, param, code}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        if len(message) > _MAX_MESSAGE:
            message = message[: _MAX_MESSAGE - 3] + "..."
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict:
        """`{"type": "error", "error": {type, message}}`, Anthropic's shape."""
        fallback = "invalid_request_error" if self.status < 500 else "api_error"
        kind = _ANTHROPIC_TYPES.get(self.status, fallback)
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, path: str = "") -> web.Response:
        """The error for a request to `path` (Anthropic's shape under /v1/messages)."""
        body = self.anthropic_body() if is_anthropic(path) else self.body()
        return web.Response(
            status=self.status,
            body=json.dumps(body).encode(),
            content_type="application/json",
            headers=self.headers,
        )


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PATHS or path.startswith(ANTHROPIC_PATHS + "/")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param, code)


def server_error(message: str = "internal server error") -> APIError:
    return APIError(500, message)
