"""`kipp`: the command line. Each subcommand lives in its own module."""

from __future__ import annotations

import importlib
import sys

from kipp_core.cli.common import Parser, UsageError

COMMANDS = {
    "generate": ("kipp_core.cli.generate", "generate text from a prompt"),
    "chat": ("kipp_core.cli.chat", "interactive multi-turn chat"),
    "serve": ("kipp_core.cli.serve", "OpenAI-compatible HTTP server"),
    "ppl": ("kipp_core.cli.ppl", "perplexity over a text file"),
    "quantize": ("kipp_core.cli.quantize", "write a quantized checkpoint"),
    "bench": ("kipp_core.cli.bench", "prefill/decode benchmarks"),
    "models": ("kipp_core.cli.models", "list the checkpoint registry"),
}

EPILOG = """examples:
  kipp generate "Write a haiku about the sea"
  kipp generate --chat "Why is the sky blue?" --max-tokens 64
  kipp serve --model qwen3-0.6b --backend cuda --port 8000
  kipp models
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(
        prog="kipp",
        description="Kipp: run Qwen3 models on your own hardware.",
        epilog=EPILOG,
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    modules = {}
    for name, (mod, helptext) in COMMANDS.items():
        modules[name] = mod
        sub.add_parser(name, help=helptext, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        from kipp_core import __version__

        print(f"kipp {__version__}")
        return 0
    if argv[0] not in modules:
        print(
            f"kipp: error: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)})",
            file=sys.stderr,
        )
        return 2
    try:
        module = importlib.import_module(modules[argv[0]])
        return module.main(argv[1:]) or 0
    except UsageError as e:
        print(f"{e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"kipp {argv[0]}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
