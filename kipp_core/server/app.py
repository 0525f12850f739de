"""The aiohttp application: routes, and the middlewares for errors, metrics and the API key."""

from __future__ import annotations

import asyncio
import hmac
import logging

from aiohttp import web

from kipp_core.server.async_engine import EngineFailure
from kipp_core.server.chat_completions import create_chat_completion
from kipp_core.server.completions import create_completion
from kipp_core.server.context import STATE, ServerState
from kipp_core.server.errors import APIError
from kipp_core.server.metrics import CONTENT_TYPE, ServerMetrics
from kipp_core.server.streaming import DISCONNECTED, dumps
from kipp_core.server.tokenize import detokenize, tokenize

log = logging.getLogger("kipp")

OPEN_PATHS = ("/health",)  # answered without the API key


def _http_error(e: web.HTTPException, request: web.Request) -> APIError:
    if e.status == 404:
        return APIError(404, f"Invalid URL ({request.method} {request.path})", code="not_found")
    text = (e.text or e.reason or "").strip()
    if text.startswith(f"{e.status}:"):
        text = text.split(":", 1)[1].strip()
    headers = {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}
    return APIError(e.status, text or e.reason, headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler):
    """Every failure becomes an OpenAI error body; each request is counted by status."""
    status = 500
    try:
        response = await handler(request)
        status = 499 if request.get(DISCONNECTED) else response.status
        return response
    except APIError as e:
        status = e.status
        return e.response()
    except EngineFailure as e:
        return APIError(500, str(e)).response()
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        return _http_error(e, request).response()
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away (nginx's code)
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "internal server error").response()
    finally:
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        request.app[STATE].metrics.requests.labels(name, str(status)).inc()


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = request.app[STATE].config.api_key
    if key and request.path not in OPEN_PATHS:
        got = request.headers.get("Authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(got, f"Bearer {key}".encode()):
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
    return await handler(request)


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(status=status, body=dumps(body), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    request.app[STATE].ready()  # 503 while loading
    return _json({"status": "ok"})


def _model_card(state: ServerState) -> dict:
    ctx = state.ready()
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "kipp",
        "max_model_len": ctx.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    return _json({"object": "list", "data": [_model_card(request.app[STATE])]})


async def get_model(request: web.Request) -> web.Response:
    card = _model_card(request.app[STATE])
    if request.match_info["model"] != card["id"]:
        raise APIError(
            404,
            f"The model `{request.match_info['model']}` does not exist.",
            "model",
            "model_not_found",
        )
    return _json(card)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def create_app(state: ServerState) -> web.Application:
    """The application over `state`; the model may still be loading."""
    state.metrics = ServerMetrics(state.engine_stats)
    app = web.Application(
        middlewares=[errors_middleware, auth_middleware],
        client_max_size=state.config.max_body_bytes,
    )
    app[STATE] = state
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    return app
