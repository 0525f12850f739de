"""Combine the winners of an in-graph tile sweep: reads step_ablation.py's --json, takes for each
GEMV shape its fastest `env:KIPP_CUDA_TUNED=family/NxK/...` variant when it beats the baseline
(the mean of `full` and any `env:KIPP_UNUSED...` control variants, which run the same graph) by
more than --margin ms, and prints one KIPP_CUDA_TUNED value joining them with ';' (empty when
none wins). The per-shape table goes to stderr.

python tools/sweep/pick_tiles.py tiles.json --quant affine4 --margin 0.002
"""

from __future__ import annotations

import argparse
import json
import sys

PREFIX = "env:KIPP_CUDA_TUNED="


def pick(times: dict[str, float], margin: float) -> tuple[str, list[str]]:
    """(the combined override, report lines) from one quant's {variant: ms}."""
    controls = [ms for v, ms in times.items() if v == "full" or v.startswith("env:KIPP_UNUSED")]
    base = sum(controls) / len(controls)
    spread = max(controls) - min(controls)
    best: dict[str, tuple[float, str]] = {}
    for v, ms in times.items():
        if v.startswith(PREFIX) and "+" not in v:
            value = v[len(PREFIX) :]
            shape = "/".join(value.split("/")[:2])
            if shape not in best or ms < best[shape][0]:
                best[shape] = (ms, value)
    lines = [f"baseline {base:.4f} ms (controls {len(controls)}, spread {spread:.4f})"]
    chosen = []
    for shape, (ms, value) in sorted(best.items()):
        win = ms < base - margin
        lines.append(f"{shape}: best {value} {ms:.4f} ms ({ms - base:+.4f}){' <-' if win else ''}")
        if win:
            chosen.append(value)
    return ";".join(chosen), lines


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("json_path")
    p.add_argument("--quant", default="affine4")
    p.add_argument("--margin", type=float, default=0.002)
    args = p.parse_args()
    with open(args.json_path) as f:
        times = json.load(f)[args.quant]
    combined, lines = pick(times, args.margin)
    print("\n".join(lines), file=sys.stderr)
    print(combined)


if __name__ == "__main__":
    main()
