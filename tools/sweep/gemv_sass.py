"""The one-token quantized GEMVs compiled for sm_90 on any machine (no GPU needed): SASS
instructions in each kernel's K loop per weight a thread handles, and registers a thread
(kipp_cuda/kernels/sass.py): the decode GEMVs' instruction budget, compared offline. At 4.3 TB/s
an H200 issues about 4.5 instructions a weight for affine4's 0.625 bytes a weight
(benchmarks/LOG.md, entry 32405f1).

python tools/sweep/gemv_sass.py [--configs 32x32x4,8x128x4] [--int-x both|on|off] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import triton

from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels import q8_0_gemv as qg
from kipp_cuda.kernels.sass import AFFINE_PACKED_SIG, AFFINE_SIG, Q8_SIG, loop_sass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="32x32x4,16x64x4,8x128x4,16x128x4", help="NxGxWARPS")
    p.add_argument("--int-x", default="both", choices=["both", "on", "off"])
    p.add_argument("--json", default=None, help="every row with its full opcode counts")
    args = p.parse_args()
    rows = []
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.int_x]
    print(f"triton {triton.__version__}, sm_90; PREFETCH off, PDL on, bf16 x")
    print("| kernel | N x G x warps | INT_X | loop instructions | per weight | registers | top |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.configs.split(","):
        bn, bg, nw = (int(v) for v in spec.split("x"))
        weights = bn * bg * 32 / (32 * nw)  # a thread's weights a K step
        common = dict(BLOCK_N=bn, BLOCK_G=bg, SPLIT_K=1, PDL=True, ASM=True, PREFETCH=False)
        for on in modes:
            affine = dict(BITS=4, GROUP=32)
            for name, fn, sig, extra in (
                ("q8_0", qg._q8_0_gemv_kernel, Q8_SIG, {}),
                # interleaved scales and biases, as AffineLinear stores them (one word a group)
                ("affine4", ag._affine_gemv_kernel, AFFINE_PACKED_SIG, {**affine, "PACKED": 2}),
                ("affine4/separate", ag._affine_gemv_kernel, AFFINE_SIG, affine),
            ):
                ops, regs = loop_sass(fn, sig, {**common, **extra, "INT_X": on}, nw)
                n = sum(ops.values())
                top = ", ".join(f"{k} {v}" for k, v in ops.most_common(4))
                print(f"| {name} | {spec} | {on} | {n} | {n / weights:.2f} | {regs} | {top} |")
                rows.append(dict(kernel=name, config=spec, int_x=on, weights=weights, ops=ops))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
