"""Time every Triton kernel against its torch reference on Qwen3 shapes, next to the device's own
measured ceilings. `python -m kipp_cuda.kernels.bench` prints a markdown table (CUDA only).

Each kernel module may define `bench_specs() -> list[dict]` with `name`, `fn`, `ref` (callables
taking no arguments), `bytes` and `flops` (the fewest the op must move and do) and optionally
`shape` and `kernels` (the dispatch names `fn` runs, when not just `name`). Bytes count every
read and write once, so GB/s compares with the copy ceiling measured here (a device-to-device
copy, read + write); TFLOP/s with a large bf16 torch.matmul.

A row is refused (reported with `refused` set and no numbers) when its kernel has fallen back to
its reference in this process, when anything falls back while it runs (kipp_core.fastpath), or
when kernels are switched off (KIPP_CUDA_DISABLE_KERNELS).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import pkgutil
import sys

import torch

from kipp_core.fastpath import fallbacks

# Qwen3 dense shapes: hidden, heads, kv heads, head_dim, intermediate.
MODELS = {"0.6B": (1024, 16, 8, 128, 3072), "8B": (4096, 32, 8, 128, 12288)}
TOKENS = (1, 16, 256, 2048)  # decode of one and of 16 sequences, prefill chunks
VOCAB = 151936
L2_FLUSH_BYTES = 256 * 2**20  # comfortably beyond the H200's 50 MB L2


def linear_shapes() -> dict[str, dict[str, tuple[int, int]]]:
    """(N, K) of each fused projection: qkv, o, gate_up, down."""
    out = {}
    for model, (h, hq, hkv, d, inter) in MODELS.items():
        out[model] = {
            "qkv": ((hq + 2 * hkv) * d, h),
            "o": (h, hq * d),
            "gate_up": (2 * inter, h),
            "down": (h, inter),
        }
    return out


def rotating(nbytes: float) -> int:
    """How many copies of an operand of `nbytes` to cycle through so that none is still in L2
    when it comes round again."""
    return max(1, min(64, math.ceil(L2_FLUSH_BYTES / max(nbytes, 1))))


def _time_ms(fn) -> float:
    import triton.testing

    fn()  # compile and warm up outside the timing
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure_ceilings(device: str = "cuda") -> dict[str, float]:
    """Copy bandwidth (GB/s, read + write counted) and bf16 matmul TFLOP/s on this device."""
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = _time_ms(lambda: dst.copy_(src))
    m = 8192
    a = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=device, dtype=torch.bfloat16)
    mm_ms = _time_ms(lambda: a @ b)
    return {"gb_s": 2 * n / copy_ms / 1e6, "tflop_s": 2 * m**3 / mm_ms / 1e9}


def spec_modules() -> list:
    """Every kernels module that defines bench_specs, in name order."""
    import kipp_cuda.kernels as pkg

    mods = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name == "bench":
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        if hasattr(mod, "bench_specs"):
            mods.append(mod)
    return mods


def _disabled() -> str | None:
    v = os.environ.get("KIPP_CUDA_DISABLE_KERNELS", "").strip()
    return f"KIPP_CUDA_DISABLE_KERNELS={v}" if v else None


def run_kernel_bench(device: str = "cuda", only: str | None = None) -> list[dict]:
    """Time each kernel and its reference; one dict a row (see the module docstring). `only`
    keeps the rows whose name contains it."""
    if not torch.cuda.is_available() or not str(device).startswith("cuda"):
        raise RuntimeError("the kernel benchmark needs a CUDA device")
    if torch.device(device).index is not None:
        torch.cuda.set_device(torch.device(device))
    return bench_rows(spec_modules(), measure_ceilings(device), only=only)


def bench_rows(
    modules,
    ceil: dict[str, float],
    timer=_time_ms,
    only: str | None = None,
) -> list[dict]:
    """The rows for every spec of `modules`, timed with `timer(fn) -> ms`."""
    rows: list[dict] = []
    disabled = _disabled()
    for mod in modules:
        for spec in mod.bench_specs():
            if only and only not in spec["name"]:
                continue
            row = {
                "name": spec["name"],
                "shape": spec.get("shape", ""),
                "module": mod.__name__,
                "bytes": spec["bytes"],
                "flops": spec["flops"],
                "ceiling_gb_s": ceil["gb_s"],
                "ceiling_tflop_s": ceil["tflop_s"],
            }
            rows.append(row)
            if disabled:
                row["refused"] = disabled
                continue
            before = fallbacks()
            try:
                ms = timer(spec["fn"])
            except Exception as e:  # a kernel that cannot run is refused, not timed
                row["refused"] = f"{type(e).__name__}: {e}"
                continue
            names = spec.get("kernels", [spec["name"]])
            new = {k: v for k, v in fallbacks().items() if k not in before or k[1] in names}
            if new:
                row["refused"] = "fell back: " + "; ".join(f"{k[1]} ({v})" for k, v in new.items())
                continue
            ref_ms = timer(spec["ref"])
            gb_s = spec["bytes"] / ms / 1e6
            tflop_s = spec["flops"] / ms / 1e9
            row.update(
                ms=ms,
                ref_ms=ref_ms,
                speedup=ref_ms / ms,
                gb_s=gb_s,
                tflop_s=tflop_s,
                bw_frac=gb_s / ceil["gb_s"],
                flop_frac=tflop_s / ceil["tflop_s"],
            )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    c = rows[0]
    lines = [
        f"Ceilings measured here: copy {c['ceiling_gb_s']:.0f} GB/s (read + write), "
        f"bf16 matmul {c['ceiling_tflop_s']:.0f} TFLOP/s.",
        "",
        "| kernel | shape | ms | ref ms | speedup | GB/s | % BW | TFLOP/s | % FLOP |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['name']} | {r['shape']} | refused: {r['refused']} | | | | | | |")
            continue
        lines.append(
            f"| {r['name']} | {r['shape']} | {r['ms']:.4f} | {r['ref_ms']:.4f} | "
            f"{r['speedup']:.1f}x | {r['gb_s']:.0f} | {100 * r['bw_frac']:.0f}% | "
            f"{r['tflop_s']:.1f} | {100 * r['flop_frac']:.0f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", help="keep kernels whose name contains this")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel benchmark: no CUDA device here; it only runs on CUDA", file=sys.stderr)
        return 2
    print(markdown(run_kernel_bench(args.device, args.only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
