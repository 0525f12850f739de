"""`kipp ppl`: perplexity over a text file by strided windows (kipp_core.perplexity)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kipp_core.cli.common import Parser, UsageError, add_model_args, load_llm, setup_logging

EPILOG = """examples:
  kipp ppl --file wiki.test.raw
  kipp ppl --model qwen3-0.6b --backend cuda --dtype float32 --file wiki.test.raw
  kipp ppl --model ./qwen3-1.7b-q8 --file book.txt --ctx 1024 --stride 512 --json

The file is read as UTF-8 and tokenized whole, without special tokens (the wikitext-2 raw files
work as they are). Windows of --ctx tokens advance by --stride; each scores only the tokens no
earlier window scored, as in the transformers guide "Perplexity of fixed-length models".
"""


def build_parser() -> Parser:
    p = Parser(
        prog="kipp ppl",
        description="Perplexity of a model over a text file.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--file", "-f", required=True, help="the text file (UTF-8)")
    p.add_argument("--ctx", type=int, default=512, help="window length in tokens (default 512)")
    p.add_argument("--stride", type=int, default=256, help="window step in tokens (default 256)")
    p.add_argument("--max-tokens", type=int, default=None, help="use only the first N tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(p)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    path = Path(args.file)
    if not path.is_file():
        raise UsageError(f"kipp ppl: error: no such file: {args.file}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise UsageError(f"kipp ppl: error: --max-tokens must be >= 2, got {args.max_tokens}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"kipp ppl: error: {args.file} is not UTF-8 text ({e.reason})") from None
    from kipp_core.perplexity import perplexity, windows

    windows(args.ctx, args.ctx, args.stride)  # a bad --ctx or --stride fails before the load
    setup_logging(args.verbose)
    llm = load_llm(args)
    ids = llm.tokenizer.encode(text)
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    r = perplexity(llm, ids, args.ctx, args.stride, use_tqdm=sys.stderr.isatty())
    if args.json:
        out = {
            "perplexity": r.perplexity,
            "nll": r.nll,
            "num_tokens": r.num_tokens,
            "num_scored": r.num_scored,
            "num_windows": r.num_windows,
            "tokens_per_second": r.tokens_per_second,
            "seconds": r.seconds,
            "ctx": args.ctx,
            "stride": args.stride,
            "backend": llm.backend_name,
        }
        print(json.dumps(out))
    else:
        print(
            f"perplexity {r.perplexity:.4f}  ({r.num_scored} tokens scored in {r.num_windows} "
            f"windows of {args.ctx}, stride {args.stride})"
        )
        print(f"{r.tokens_per_second:.1f} tokens/s ({r.num_evaluated} tokens in {r.seconds:.2f} s)")
    return 0
