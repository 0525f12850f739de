"""`kipp quantize`: write a quantized checkpoint (kipp_core.quantize_checkpoint)."""

from __future__ import annotations

import argparse
import sys

from kipp_core.cli.common import Parser, bad, positive_int, setup_logging
from kipp_core.quant import SCHEMES

EPILOG = """examples:
  kipp quantize --model qwen3-0.6b --scheme q8_0 --out ./qwen3-0.6b-q8_0
  kipp quantize --model ./my-qwen3 --scheme affine4 --group-size 32 --out ./my-qwen3-4bit --force
  kipp generate --model ./qwen3-0.6b-q8_0 "Hello"

The output holds safetensors plus config.json with a "quantization" entry; the oracle and both GPU
backends load it. The embedding, the head and every linear are quantized; norms are copied.
"""


def build_parser() -> Parser:
    p = Parser(
        prog="kipp quantize",
        description="Quantize a float checkpoint's weights and write a new checkpoint.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", "-m", required=True, help="source: a directory or registry name")
    p.add_argument("--scheme", required=True, choices=list(SCHEMES), help="quantization scheme")
    p.add_argument(
        "--group-size", type=positive_int, default=32, help="elements per scale (default 32)"
    )
    p.add_argument("--out", "-o", required=True, help="destination directory")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _check_writable(out) -> None:
    """--out can be made: a temporary directory beside it is (before any weight is read)."""
    import tempfile

    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    try:
        tempfile.TemporaryDirectory(dir=parent).cleanup()
    except OSError as e:
        raise bad("kipp quantize", "--out", f"cannot write in {parent}: {e.strerror}") from None


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**28 else f"{n / 2**20:.2f} MiB"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    from pathlib import Path

    from tqdm import tqdm

    from kipp_core.checkpoint import Checkpoint
    from kipp_core.quantize_checkpoint import quantize_checkpoint
    from kipp_core.resolve import resolve_model

    if Path(args.out).exists() and not args.force:  # before a possible download
        raise ValueError(f"{args.out} exists; pass --force to overwrite it")
    _check_writable(Path(args.out))
    path, entry = resolve_model(args.model)
    src = Checkpoint(path, entry)
    bar = tqdm(
        total=1,
        desc=f"quantize {args.scheme}",
        unit="B",
        unit_scale=True,
        disable=not sys.stderr.isatty(),
        dynamic_ncols=True,
    )

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        r = quantize_checkpoint(src, args.out, args.scheme, args.group_size, args.force, progress)
    except OSError as e:
        raise bad("kipp quantize", "--out", f"cannot write {args.out}: {e.strerror}") from None
    finally:
        bar.close()
    print(
        f"wrote {r.out}: {r.num_quantized} weights quantized ({args.scheme}), "
        f"{r.num_copied} tensors copied"
    )
    print(f"size {_gib(r.src_bytes)} -> {_gib(r.dst_bytes)} ({r.dst_bytes / r.src_bytes:.3f}x)")
    print(f"weight reconstruction error (relative RMS) {r.rel_rms_error:.3e}")
    return 0
