"""`kipp serve`: the OpenAI-compatible HTTP server (kipp_core.server) over one model."""

from __future__ import annotations

import asyncio
import logging
import signal

from kipp_core.cli.common import (
    Parser,
    add_model_args,
    check_model_args,
    load_llm,
    port,
    positive_float,
    positive_int,
    setup_logging,
)
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
        description="Serve a model over OpenAI's /v1/completions and /v1/chat/completions.",
        epilog=EPILOG,
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8000, help="port (0 picks a free one)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
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
    s.add_argument(
        "--keep-alive-timeout",
        type=positive_float,
        default=5.0,
        help="seconds before an idle connection is closed",
    )
    add_model_args(p)
    return p


def _loader(args):
    def load():
        return load_llm(args, max_waiting=args.max_waiting)

    return load


async def _serve(args) -> None:
    from kipp_core.server.context import ServerConfig
    from kipp_core.server.server import APIServer

    config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name or args.model,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        keepalive_timeout=args.keep_alive_timeout,
        default_max_tokens=args.default_max_tokens,
    )
    server = APIServer(config, loader=_loader(args))
    await server.start()
    log.info(
        "serving %s on http://%s:%d (loading the model)",
        config.served_model_name,
        args.host,
        server.port,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on this platform / thread
            pass
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([server.loaded, stopped], return_when=asyncio.FIRST_COMPLETED)
        if server.loaded.done():
            server.loaded.result()  # raises if loading failed
            log.info("model loaded; ready")
            await stopped
    finally:
        stopped.cancel()
        await server.stop()


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    check_model_args(args, "kipp serve")
    check_model_name(args.model)  # a name that names nothing fails before the socket is bound
    try:
        asyncio.run(_serve(args))
    except (OSError, RuntimeError) as e:  # load failures that are not ValueErrors: one line
        raise ValueError(f"{type(e).__name__}: {e}") from None
    return 0
