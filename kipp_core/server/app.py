"""The aiohttp application: routes, and the middlewares for errors, metrics and the API key."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from kipp_core.server.access_log import log_request
from kipp_core.server.async_engine import EngineFailure
from kipp_core.server.body import expect_continue
from kipp_core.server.chat_completions import create_chat_completion
from kipp_core.server.completions import create_completion
from kipp_core.server.context import STATE, ServerState
from kipp_core.server.errors import APIError
from kipp_core.server.http_layer import no_versions
from kipp_core.server.messages import count_tokens, create_message
from kipp_core.server.metrics import CONTENT_TYPE, ServerMetrics
from kipp_core.server.responses import create_response
from kipp_core.server.streaming import DISCONNECTED, WRITE_WATCH, dumps
from kipp_core.server.tokenize import detokenize, tokenize
from kipp_core.server.write_watch import WriteWatch

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
    """Every failure becomes an error body (OpenAI's, or Anthropic's under /v1/messages); each
    request is counted by status and logged (access_log.py)."""
    status = 500
    started = time.monotonic()
    state = request.app[STATE]
    state.inflight += 1
    try:
        response = await handler(request)
        status = 499 if request.get(DISCONNECTED) else response.status
        return response
    except APIError as e:
        status = e.status
        return e.response(request.path)
    except EngineFailure as e:
        return APIError(500, str(e)).response(request.path)
    except web.HTTPException as e:
        status = e.status
        if e.status < 400:
            raise
        return _http_error(e, request).response(request.path)
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499  # the client went away (nginx's code)
        raise
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return APIError(500, "internal server error").response(request.path)
    finally:
        state.inflight -= 1
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        state.metrics.requests.labels(name, str(status)).inc()
        if state.config.access_log:
            log_request(request, status, started)


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def _host_allowed(request: web.Request, config) -> bool:
    host = request.host or ""
    if host.startswith("["):  # [::1]:8000
        host = host[1 : host.find("]")]
    elif host.count(":") == 1:
        host = host.rsplit(":", 1)[0]
    host = host.lower().rstrip(".")
    allowed = {*LOOPBACK_HOSTS, *config.allowed_hosts}
    if config.host not in ("0.0.0.0", "::", ""):
        allowed.add(config.host)
    return "*" in allowed or host in allowed or host.endswith(".localhost")


def _same(token: str, key: str) -> bool:
    return hmac.compare_digest(token.encode("utf-8", "replace"), key.encode())


@web.middleware
async def auth_middleware(request: web.Request, handler):
    """The API key ('Authorization: Bearer KEY', the scheme in any case, or Anthropic's
    'x-api-key: KEY'; every key sent must be right); without one, only requests to a loopback
    or allowed Host name (DNS rebinding)."""
    config = request.app[STATE].config
    key = config.api_key
    if request.path in OPEN_PATHS:
        return await handler(request)
    if key:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else None
        ok = [t for t in (bearer, request.headers.get("x-api-key")) if t is not None]
        if not ok or not all(_same(t, key) for t in ok):
            raise APIError(
                401,
                "Incorrect or missing API key: send 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'",
                code="invalid_api_key",
            )
    elif not _host_allowed(request, config):
        raise APIError(
            403,
            f"Host {request.host!r} is not allowed: without an API key the server answers only "
            "loopback names and --allowed-host ones",
            code="host_not_allowed",
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
    app[WRITE_WATCH] = watch = WriteWatch(state.config.write_timeout)

    async def stop_watch(_app) -> None:
        watch.stop()

    app.on_cleanup.append(stop_watch)
    app.on_response_prepare.append(no_versions)
    app.router.add_post("/v1/completions", create_completion, expect_handler=expect_continue)
    for path, handler in (
        ("/v1/chat/completions", create_chat_completion),
        ("/v1/messages", create_message),
        ("/v1/messages/count_tokens", count_tokens),
        ("/v1/responses", create_response),
    ):
        app.router.add_post(path, handler, expect_handler=expect_continue)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    return app
