"""Benchmarks: the same as `kipp bench` (kipp_core/cli/bench.py); see --help."""

from __future__ import annotations

import sys

from kipp_core.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
