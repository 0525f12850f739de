"""The MLX paged decode attention kernel's device time a call against what mlx-lm runs for the
same decode (mx.fast.scaled_dot_product_attention over a contiguous cache: cuDNN on MLX's CUDA
build) and the kernel's reference (gather + SDPA), at registry head shapes, batches and
contexts; the kernel's output is checked against the reference first. Device time per call from
CUPTI (torch.profiler), so the host's launch cost is left out. `--chained` also times the calls
queued in one evaluation (the GPU kept busy: a kernel much faster so is bound by latency or a
low idle clock, not bytes); `--splits` also times the kernel at each split count. Needs MLX on a
GPU (and torch with CUDA for the profiler).

python tools/profile/mlx_attention_bench.py [--chained] [--splits] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kipp_mlx.kernels import decode_attention as da  # noqa: E402
from kipp_mlx.kernels import ladder  # noqa: E402

# (name, query heads, kv heads, head dim): Qwen3 0.6B and 8B
SHAPES = [("qwen3-0.6b", 16, 8, 128), ("qwen3-8b", 32, 8, 128)]
CASES = [(1, 128), (1, 2048), (1, 32768), (64, 2048)]  # (batch, context)
BLOCK = 32


def device_us(fn, calls: int, chained: bool = False) -> dict[str, float]:
    """Each kernel's device microseconds a call of fn, over `calls` calls evaluated one by one
    (`chained`: all in one evaluation, back to back on the GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    mx.eval(fn())  # compiled and warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if chained:
            mx.eval([fn() for _ in range(calls)])
        else:
            for _ in range(calls):
                mx.eval(fn())
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            out[e.key[:60]] = t / calls
    torch.cuda.synchronize()
    return out


def case(name, hq, hkv, d, batch, ctx, kind, args) -> dict:
    q, pool, tables, lens, scale, bs = da.probe_inputs(
        hq, hkv, d, BLOCK, mx.bfloat16, seed=1, lens=(ctx,) * batch
    )
    k = mx.random.normal((batch, hkv, ctx, d)).astype(mx.bfloat16)
    v = mx.random.normal((batch, hkv, ctx, d)).astype(mx.bfloat16)
    fns = {
        "kipp": lambda: da.decode_attention(
            q, pool, tables, lens, scale, bs, kind=kind, max_context=ctx
        ),
        "sdpa": lambda: mx.fast.scaled_dot_product_attention(q[:, :, None, :], k, v, scale=scale),
        "reference": lambda: da.decode_attention_ref(q, pool, tables, lens, scale, bs),
    }
    diff = fns["kipp"]().astype(mx.float32) - fns["reference"]().astype(mx.float32)
    err = float(mx.max(mx.abs(diff)))
    row = {"shape": name, "batch": batch, "context": ctx, "max_abs_err": err}
    for label, fn in fns.items():
        times = device_us(fn, args.calls)
        row[f"{label}_us"] = round(sum(times.values()), 2)
        row[f"{label}_kernels"] = {k: round(t, 2) for k, t in times.items()}
        if args.chained and label != "reference":
            row[f"{label}_chained_us"] = round(sum(device_us(fn, args.calls, True).values()), 2)
    if args.splits:
        row["kipp_splits_us"] = {}
        for n in (1, 2, 4, 8, 16, 32, 64, 128):
            if n > -(-ctx // BLOCK):
                break
            fn = lambda n=n: da.decode_attention(  # noqa: E731
                q, pool, tables, lens, scale, bs, kind=kind, max_context=ctx, splits=n
            )
            row["kipp_splits_us"][n] = round(sum(device_us(fn, args.calls).values()), 2)
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    row["kipp_gb_s"] = round(kv_bytes / row["kipp_us"] / 1e3, 1)
    print(
        f"{name:11s} batch {batch:3d} context {ctx:6d}: kipp {row['kipp_us']:8.1f} us "
        f"({row['kipp_gb_s']:6.1f} GB/s), sdpa {row['sdpa_us']:8.1f}, reference "
        f"{row['reference_us']:9.1f}; max |kipp - ref| {err:.2e}",
        flush=True,
    )
    for key in ("kipp_chained_us", "sdpa_chained_us", "kipp_splits_us"):
        if key in row:
            print(f"    {key}: {row[key]}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--chained", action="store_true")
    p.add_argument("--splits", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    kind = ladder.gpu_kind()
    if kind is None:
        print("mlx_attention_bench: MLX runs on the CPU here; nothing to measure")
        return 2
    rows = []
    for name, hq, hkv, d in SHAPES:
        for batch, ctx in CASES:
            rows.append(case(name, hq, hkv, d, batch, ctx, kind, args))
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
