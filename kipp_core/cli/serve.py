"""`kipp serve`: the OpenAI- and Anthropic-compatible HTTP server (kipp_core.server) over one
model."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

from kipp_core.cli.common import (
    Parser,
    UsageError,
    add_model_args,
    add_thinking_budget,
    announce,
    check_model_args,
    llm_kwargs,
    load_llm,
    non_negative_float,
    port,
    positive_float,
    positive_int,
    setup_logging,
)
from kipp_core.gc_heap import freeze_loaded_heap
from kipp_core.resolve import check_model_name

log = logging.getLogger("kipp")

EPILOG = """examples:
  kipp serve --model kipp-tiny --backend oracle --port 8000
  kipp serve --model qwen3-0.6b --backend cuda --host 0.0.0.0 --api-key secret
  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hi"}]}'
"""


def build_parser() -> Parser:
    p = Parser(
        prog="kipp serve",
        description="Serve a model over OpenAI's /v1/completions, /v1/chat/completions and "
        "/v1/responses, and Anthropic's /v1/messages.",
        epilog=EPILOG,
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8000, help="port (0 picks a free one)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (visible in ps: prefer KIPP_API_KEY or "
        "--api-key-file)",
    )
    s.add_argument("--api-key-file", default=None, help="read the API key from this file")
    s.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="without an API key, also answer this Host name (repeatable; '*' for any); "
        "loopback names always",
    )
    s.add_argument("--served-model-name", default=None, help="the model id clients use")
    s.add_argument(
        "--max-waiting",
        type=positive_int,
        default=256,
        help="waiting-queue size; beyond it requests get 429",
    )
    s.add_argument(
        "--max-body-mb", type=positive_float, default=16.0, help="request body limit (413)"
    )
    s.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=None,
        help="cap for chat requests without max_tokens (default: the rest of the context, as vLLM)",
    )
    add_thinking_budget(s, "of chat requests that set none")
    s.add_argument(
        "--keep-alive-timeout",
        type=positive_float,
        default=5.0,
        help="seconds before an idle connection is closed",
    )
    for flag, default, what in (
        ("--write-timeout", 30.0, "seconds a stream may wait on a client that reads nothing"),
        ("--body-timeout", 30.0, "seconds a request body may take to arrive (408)"),
        ("--shutdown-timeout", 30.0, "seconds in-flight requests get after SIGTERM/SIGINT"),
    ):
        s.add_argument(
            flag, type=non_negative_float, default=default, help=f"{what} (default {default:g})"
        )
    s.add_argument("--no-access-log", action="store_true", help="no line per request")
    s.add_argument(
        "--engine-in-process",
        action="store_true",
        help="run the engine on a thread of the server's process instead of a process of its "
        "own (they then share one GIL: slower on a GPU)",
    )
    add_model_args(p)
    return p


def api_key(args) -> str | None:
    """--api-key, else the first line of --api-key-file, else $KIPP_API_KEY."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text("utf-8").strip()
        except OSError as e:
            raise UsageError(f"kipp serve: error: --api-key-file: {e.strerror}") from None
        if not key:
            raise UsageError(f"kipp serve: error: --api-key-file {args.api_key_file} is empty")
        return key
    return os.environ.get("KIPP_API_KEY") or None


def _loader(args):
    def load():
        # A server sizes its KV cache for its concurrent streams (kipp_core.kv_budget).
        return load_llm(args, max_waiting=args.max_waiting, kv_sizing="serving")

    return load


def _engine_process(args):
    """The front end for this process and the engine process (kipp_core.server.engine_process)
    that loads the same LLM."""

    def make():
        from kipp_core.frontend import Frontend
        from kipp_core.server.engine_process import EngineProcess

        kw = llm_kwargs(args, max_waiting=args.max_waiting, kv_sizing="serving")
        front = Frontend(
            args.model,
            max_model_len=kw["max_model_len"],
            rope_scaling=kw["rope_scaling"],
            max_waiting=kw["max_waiting"],
            speculative=bool(kw["speculative"] or kw["speculative_model"]),
        )
        announce(args, front.registry_entry)
        return front, EngineProcess(args.model, kw)

    return make


async def _serve(args) -> None:
    from kipp_core.server.context import ServerConfig
    from kipp_core.server.server import APIServer

    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.key,
        served_model_name=args.served_model_name or args.model,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        keepalive_timeout=args.keep_alive_timeout,
        write_timeout=args.write_timeout,
        body_timeout=args.body_timeout,
        shutdown_timeout=args.shutdown_timeout,
        access_log=not args.no_access_log,
        allowed_hosts=tuple(h.lower() for h in args.allowed_host),
        default_max_tokens=args.default_max_tokens,
        default_thinking_budget=args.thinking_budget,
    )
    if args.engine_in_process:
        server = APIServer(config, loader=_loader(args))
    else:
        server = APIServer(config, engine_process=_engine_process(args))
    await server.start()
    log.info(
        "serving %s on http://%s:%d (loading the model)",
        config.served_model_name,
        args.host,
        server.port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():  # the second signal: no more waiting
            log.warning("second signal: exiting now")
            os._exit(1)
        log.info("shutting down: draining requests for up to %gs", config.shutdown_timeout)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not on this platform / thread
            pass
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([server.loaded, stopped], return_when=asyncio.FIRST_COMPLETED)
        if server.loaded.done():
            server.loaded.result()  # raises if loading failed
            server.state.ctx.offload.start()  # its fork must not pause a request later
            freeze_loaded_heap()  # the tokenizer and templates, out of full collections
            log.info("model loaded; ready")
            await stopped
    finally:
        stopped.cancel()
        await server.drain(config.shutdown_timeout)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.key = api_key(args)
    setup_logging(args.verbose)
    check_model_args(args, "kipp serve")
    check_model_name(args.model)  # a name that names nothing fails before the socket is bound
    try:
        asyncio.run(_serve(args))
    except (OSError, RuntimeError) as e:  # load failures that are not ValueErrors: one line
        raise ValueError(f"{type(e).__name__}: {e}") from None
    return 0
