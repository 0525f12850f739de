"""Write a random-weight checkpoint in any registry shape (kipp_core.tiny.random_checkpoint).

python tools/make_checkpoint.py --shape qwen3-8b --out /tmp/qwen3-8b-random
python tools/make_checkpoint.py --shape qwen3-0.6b --out ./r06 --dtype float32 --seed 3
"""

from __future__ import annotations

import argparse
import sys

from kipp_core.cli.common import Parser, UsageError


def main(argv: list[str]) -> int:
    p = Parser(
        prog="make_checkpoint.py",
        description="Write a checkpoint of a registry shape with random weights.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", required=True, help="a registry name (kipp models)")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing checkpoint")
    try:
        args = p.parse_args(argv)
        from tqdm import tqdm

        from kipp_core.tiny import random_checkpoint

        with tqdm(total=1, desc=args.shape, unit="param", unit_scale=True, disable=None) as bar:

            def progress(done, total):
                bar.total = total
                bar.update(done - bar.n)

            out = random_checkpoint(
                args.shape, args.out, args.dtype, args.seed, progress, force=args.force
            )
    except (UsageError, ValueError) as e:
        print(
            f"make_checkpoint.py: error: {e}" if isinstance(e, ValueError) else e, file=sys.stderr
        )
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
