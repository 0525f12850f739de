"""Experiment (fifteenth session): how much faster the 8B affine4 one-token GEMVs run when x's
int16 form (bits.quant_x16: words, scales, sums) is read precomputed (XQ) instead of made by every
program; tuned configs, and XQ's best over kernel_sweep's int16-x grid; weights streamed from HBM
(kernel_sweep.rotated), CUDA graphs of back-to-back calls. An upper bound on what a cheap producer
of xq could save: the producer's own cost is not in it.

python scripts/xq_ab.py
"""

from __future__ import annotations

import torch

from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels.bits import xq_ref
from scripts.kernel_sweep import graph_us, quant_grid, rotated, rotating_call

SHAPES = {
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "gate_up": (24576, 4096, True),
    "down": (4096, 12288, False),
}


def _call(x, cfg, swiglu, xq):
    def call(wq, s, b):
        return ag.affine_gemv(x, wq, s, b, 4, 32, cfg, swiglu=swiglu, xq=xq)

    return call


def _weights(N, K):
    return rotated(
        lambda: (
            torch.randint(-(2**31), 2**31, (N, K // 8), dtype=torch.int32, device="cuda"),
            (torch.rand(N, K // 32, device="cuda") * 0.01).bfloat16(),
            (torch.rand(N, K // 32, device="cuda") * -0.05).bfloat16(),
        ),
        N * K // 2 + N * K // 32 * 4,
    )


def main() -> None:
    print("| GEMV | config | plain us | XQ us | saved us | max abs diff | XQ best us, config |")
    print("|---|---|---:|---:|---:|---:|---|")
    total = [0.0, 0.0, 0.0]
    for name, (N, K, swiglu) in SHAPES.items():
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        xq = xq_ref(x[0])
        weights = _weights(N, K)
        cfg = ag.gemv_config(N, K // 32, 32, x.device)
        us, outs = [], []
        for use in (None, xq):
            call = _call(x, cfg, swiglu, use)
            outs.append(call(*weights[0]).float())
            us.append(min(graph_us(rotating_call(call, weights)) for _ in range(3)))
        diff = (outs[0] - outs[1]).abs().max().item()
        grid = [c for c in quant_grid(N, K) if not swiglu or c["BLOCK_N"] >= 2]
        best = min(
            (graph_us(rotating_call(_call(x, c, swiglu, xq), weights)), str(c)) for c in grid
        )
        for i, v in enumerate((us[0], us[1], best[0])):
            total[i] += v
        print(
            f"| {name} {N}x{K} | {cfg} | {us[0]:.2f} | {us[1]:.2f} | {us[0] - us[1]:.2f} "
            f"| {diff:.3g} | {best[0]:.2f} {best[1]} |",
            flush=True,
        )
    print(
        f"| a layer | | {total[0]:.2f} | {total[1]:.2f} | {total[0] - total[1]:.2f} | "
        f"| {total[2]:.2f} |"
    )
    print(
        f"36 layers: {36 * (total[0] - total[1]) / 1e3:.3f} ms a step at the tuned tiles, "
        f"{36 * (total[0] - total[2]) / 1e3:.3f} at XQ's best tiles"
    )


if __name__ == "__main__":
    main()
