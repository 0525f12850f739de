"""`kipp ppl`: perplexity over a text file by strided windows (kipp_core.perplexity)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kipp_core.cli.common import (
    Parser,
    add_model_args,
    bad,
    check_model_args,
    load_llm,
    number,
    positive_int,
    setup_logging,
)

ctx_len = number(int, 2)  # a window scores from its second token on

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
    p.add_argument("--ctx", type=ctx_len, default=512, help="window length in tokens (default 512)")
    p.add_argument(
        "--stride", type=positive_int, default=256, help="window step in tokens (default 256)"
    )
    p.add_argument("--max-tokens", type=ctx_len, default=None, help="use only the first N tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(p)
    return p


def main(argv: list[str]) -> int:
    """Everything that can be wrong with the arguments, the file or the model's context fails
    before the model loads (the tokenizer and config.json are enough to tell)."""
    args = build_parser().parse_args(argv)
    prog = "kipp ppl"
    path = Path(args.file)
    if not path.is_file():
        raise bad(prog, "--file", f"no such file: {args.file}")
    if args.stride > args.ctx:
        raise bad(prog, "--stride", f"must be <= --ctx ({args.ctx}), got {args.stride}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise bad(prog, "--file", f"{args.file} is not UTF-8 text ({e.reason})") from None
    setup_logging(args.verbose)
    check_model_args(args, prog)
    from kipp_core.checkpoint import Checkpoint
    from kipp_core.perplexity import perplexity
    from kipp_core.resolve import resolve_model
    from kipp_core.tokenizer import Tokenizer

    model_path, entry = resolve_model(args.model)
    context = Checkpoint(model_path, entry).config.max_position_embeddings
    context = min(args.max_model_len or context, context)
    if args.ctx > context:
        raise bad(prog, "--ctx", f"must be <= the model's context ({context}), got {args.ctx}")
    ids = Tokenizer(model_path).encode(text)[: args.max_tokens]
    if len(ids) < 2:
        raise bad(prog, "--file", f"{args.file} has {len(ids)} token(s); perplexity needs 2")
    llm = load_llm(args)
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
