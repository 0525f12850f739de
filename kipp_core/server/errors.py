"""OpenAI error bodies. Every failure a client sees is one of these; never a traceback."""

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

    def response(self) -> web.Response:
        return web.Response(
            status=self.status,
            body=json.dumps(self.body()).encode(),
            content_type="application/json",
            headers=self.headers,
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def not_found(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(404, message, param, code)


def server_error(message: str = "internal server error") -> APIError:
    return APIError(500, message)
