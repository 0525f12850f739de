"""Sweep the decode GEMVs' and small kernels' launch configurations at Qwen3 shapes, timed inside
CUDA graphs (the regime the decode step runs in: launch gaps included, host overhead excluded).
Prints, per shape, the default configuration's time and the best ones; `--json` keeps every row.

python tools/sweep/kernel_sweep.py [--only dense,q8_0,affine4,small] [--json out.json]
(decode attention: tools/sweep/attention_sweep.py)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import triton

from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import dense_gemv as dg
from kipp_cuda.kernels import q8_0_gemv as qg
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels.bench import rotating
from kipp_cuda.kernels.matmul_tiles import pick_split_k
from kipp_cuda.quant import interleave_scale_bias

SHAPES = {  # (N, K) of each decode linear
    "0.6B qkv": (4096, 1024),
    "0.6B o": (1024, 2048),
    "0.6B gate_up": (6144, 1024),
    "0.6B down": (1024, 3072),
    "0.6B lm_head": (151936, 1024),
    "8B qkv": (6144, 4096),
    "8B o": (4096, 4096),
    "8B gate_up": (24576, 4096),
    "8B down": (4096, 12288),
    "8B lm_head": (151936, 4096),
    # one rank's shard under --tensor-parallel 2 (column-parallel qkv/gate_up/head, row-parallel
    # o/down)
    "8B/tp2 qkv": (3072, 4096),
    "8B/tp2 o": (4096, 2048),
    "8B/tp2 gate_up": (12288, 4096),
    "8B/tp2 down": (4096, 6144),
    "8B/tp2 lm_head": (75968, 4096),
    "32B/tp2 qkv": (5120, 5120),
    "32B/tp2 o": (5120, 4096),
    "32B/tp2 gate_up": (25600, 5120),
    "32B/tp2 down": (5120, 12800),
    "32B/tp2 lm_head": (75968, 5120),
}
TUNED = "kipp_cuda/kernels/configs/h200_gemv.json"


def graph_us(fn, reps: int = 20, iters: int = 10) -> float:
    """Microseconds a call, from `reps` back-to-back calls captured in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (iters * reps)


def timed(cfg: dict, fn, ref: torch.Tensor, nbytes: int, **graph_kw) -> dict:
    """One config's row: fn() checked against `ref` first (rel err < 2e-2), then timed by
    graph_us; a config that fails to compile or computes wrong is reported with its error."""
    try:
        err = ((fn().float() - ref.float()).norm() / ref.float().norm()).item()
        if not err < 2e-2:
            raise AssertionError(f"wrong result, rel err {err:.2e}")
        us = graph_us(fn, **graph_kw)
    except Exception as e:  # noqa: BLE001 - a failing config is reported, not fatal
        return {"cfg": cfg, "error": str(e)[:120]}
    return {"cfg": cfg, "us": us, "gbs": nbytes / us / 1e3}


def sweep(
    rows: list,
    family: str,
    shape: str,
    nbytes: int,
    default: dict,
    grid: list[dict],
    make_fn,
    check,
) -> None:
    ref = check()
    results = [timed(cfg, make_fn(cfg), ref, nbytes) for cfg in [default, *grid]]
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    d = results[0]
    print(
        f"{family:8} {shape:14} default {d.get('us', float('nan')):7.2f} us "
        f"{d.get('gbs', 0):6.0f} GB/s {d['cfg']}"
    )
    for r in ok[:3]:
        print(f"{'':24} best {r['us']:7.2f} us {r['gbs']:6.0f} GB/s {r['cfg']}")
    rows.append({"family": family, "shape": shape, "bytes": nbytes, "results": results})


def dense(rows, shapes):
    for name, (N, K) in shapes.items():
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
        ref = lambda x=x, w=w: torch.nn.functional.linear(x, w)  # noqa: E731
        rows.append({"family": "cublas", "shape": name, "us": graph_us(ref), "bytes": N * K * 2})
        print(
            f"cublas   {name:14} {rows[-1]['us']:7.2f} us "
            f"{N * K * 2 / rows[-1]['us'] / 1e3:6.0f} GB/s"
        )
        grid = [
            dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=nw)
            for bn, bk, s, nw in itertools.product(
                (2, 4, 8, 16), (256, 512, 1024, 2048), (1, 2, 4, 8), (4, 8)
            )
            if 1024 <= bn * bk <= 16384 and K // s >= bk
        ]
        sweep(
            rows,
            "dense",
            name,
            N * K * 2,
            dg.gemv_config(N, K, x.device),
            grid,
            lambda c, x=x, w=w: lambda: dg._dense_gemv_op(x, w, config=c),
            ref,
        )


def quant_grid(N: int, K: int) -> list[dict]:
    """Quantized GEMV tiles for the int16-x path (bits.py): a thread holds BLOCK_N * BLOCK_G /
    (32 num_warps) rows of one group (4, 8 or 16; more rows share the group's quantized x), each
    with and without the next K step's loads in flight (PREFETCH); split-K as the heuristic
    picks it for the row count."""
    dev = torch.device("cuda")
    grid = []
    tiles = (
        (4, 128, 4),
        (8, 32, 4),
        (8, 64, 4),
        (8, 128, 4),
        (16, 64, 4),
        (16, 128, 4),
        (8, 64, 8),
        (8, 128, 8),
    )
    if WIDE:  # every (rows a thread, groups a K step, warps) of 2-16 x 32-256 x 4-8
        tiles = tuple(itertools.product((2, 4, 8, 16), (32, 64, 128, 256), (4, 8)))
    for (pt, bg, nw), pf in itertools.product(tiles, (True, False)):
        bg = min(bg, triton.next_power_of_2(K // 32))
        bn = pt * 32 * nw // bg
        split = pick_split_k(dev, triton.cdiv(N, bn), triton.cdiv(K // 32, bg), 1)
        cfg = dict(BLOCK_N=bn, BLOCK_G=bg, SPLIT_K=split, num_warps=nw, PREFETCH=pf, INT_X=True)
        if cfg not in grid:
            grid.append(cfg)
    return grid


def rotated(make, nbytes: int) -> list:
    """Identical copies of a shape's weights, enough (bench.rotating) that a graph of back-to-back
    calls streams each from HBM, not from the 50 MB L2 (the decode step's regime)."""
    first = make()
    return [first] + [tuple(t.clone() for t in first) for _ in range(rotating(nbytes) - 1)]


def rotating_call(call, weights: list):
    state = {"i": 0}

    def fn():
        state["i"] = (state["i"] + 1) % len(weights)
        return call(*weights[state["i"]])

    return fn


def split_grid(default: dict) -> list[dict]:
    """Split-K with tall tiles (--split-k): more rows share each group's quantized x, and the K
    splits keep the program count up. quant_grid takes split-K only where rows alone leave SMs
    idle, so at the 8B o/down/qkv shapes it tried 4-16-row tiles over the whole of K."""
    return [
        dict(
            BLOCK_N=bn,
            BLOCK_G=bg,
            SPLIT_K=sk,
            num_warps=4,
            PREFETCH=pf,
            INT_X=default.get("INT_X", False),
        )  # fmt: skip
        for (bn, bg), sk, pf in itertools.product(
            ((8, 64), (16, 32), (16, 64), (32, 32), (32, 64)), (2, 4, 8), (False, True)
        )
    ]


SPLIT_ONLY = False  # --split-k: the quantized shapes sweep split_grid instead
WIDE = False  # --wide: quant_grid over every tile of its ranges


def quant_sweep(rows, family: str, name: str, nbytes: int, default: dict, weights, call, ref):
    """The int16-x grid (split_grid with --split-k), and the default config (the tuned table's,
    on the exact fp32 path unless it says INT_X) with INT_X off as the baseline in the same
    run."""
    grid = split_grid(default) if SPLIT_ONLY else quant_grid(*SHAPES[name])
    sweep(
        rows,
        family,
        name,
        nbytes,
        default,
        [{**default, "INT_X": False}, *grid],
        lambda c: rotating_call(lambda *w: call(*w, c), weights),
        ref,
    )


def q8(rows, shapes):
    for name, (N, K) in shapes.items():
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        nbytes = N * K * 34 // 32
        weights = rotated(
            lambda N=N, K=K: (
                torch.randint(-127, 128, (N, K), dtype=torch.int8, device="cuda"),
                (torch.rand(N, K // 32, device="cuda") * 0.01).half(),
            ),
            nbytes,
        )
        quant_sweep(
            rows,
            "q8_0",
            name,
            nbytes,
            qg.gemv_config(N, K // 32, x.device),
            weights,
            lambda qs, d, c, x=x: qg.q8_0_gemv(x, qs, d, c),
            lambda x=x, w=weights[0]: qm.q8_0_matmul_ref(x, *w),
        )


def affine4(rows, shapes):
    """On scales and biases interleaved as AffineLinear stores them (one 32-bit load a group);
    then the best config on them and on separate tensors (two 16-bit loads), the layout's A/B."""
    for name, (N, K) in shapes.items():
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        nbytes = N * K // 2 + N * K // 32 * 4
        weights = rotated(
            lambda N=N, K=K: (
                torch.randint(-(2**31), 2**31, (N, K // 8), dtype=torch.int32, device="cuda"),
                interleave_scale_bias(
                    (torch.rand(N, K // 32, device="cuda") * 0.01).bfloat16(),
                    (torch.rand(N, K // 32, device="cuda") * -0.05).bfloat16(),
                ),
            ),
            nbytes,
        )
        default = ag.gemv_config(N, K // 32, 32, x.device)
        call = lambda wq, sb, c, x=x: ag.affine_gemv(x, wq, sb[..., 0], sb[..., 1], 4, 32, c)  # noqa: E731
        quant_sweep(
            rows,
            "affine4",
            name,
            nbytes,
            default,
            weights,
            call,
            lambda x=x, w=weights[0]: am.affine_matmul_ref(
                x, w[0], w[1][..., 0], w[1][..., 1], 4, 32
            ),
        )
        best = min((r for r in rows[-1]["results"] if "us" in r), key=lambda r: r["us"])["cfg"]
        apart = [(wq, sb[..., 0].contiguous(), sb[..., 1].contiguous()) for wq, sb in weights]
        fns = {
            "interleaved": rotating_call(lambda wq, sb, c=best, f=call: f(wq, sb, c), weights),
            "separate": rotating_call(
                lambda wq, s, b, x=x, c=best: ag.affine_gemv(x, wq, s, b, 4, 32, c), apart
            ),
        }
        ab = {k: [] for k in fns}
        for _ in range(3):  # alternating, so that clocks and L2 state favour neither
            for k, fn in fns.items():
                ab[k].append(graph_us(fn))
        us = {k: min(v) for k, v in ab.items()}
        print(f"{'':24} best config: interleaved {us['interleaved']:7.2f} us, "
              f"separate {us['separate']:7.2f} us (best of 3 each)")  # fmt: skip
        rows.append({"family": "affine4/ab", "shape": name, "cfg": best, "us": ab})
        del apart


def small(rows):
    from kipp_cuda.kernels.qk_norm_rope import _qk_norm_rope_op, rope_cos_sin_cache
    from kipp_cuda.kernels.rms_norm import _rms_norm_op
    from kipp_cuda.kernels.swiglu import _silu_and_mul_op

    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    cs = rope_cos_sin_cache(4096, 128, 1e6, "cuda")
    pos = torch.tensor([100], device="cuda")
    hw = torch.randn(128, device="cuda", dtype=torch.bfloat16)
    gu = torch.randn(1, 6144, device="cuda", dtype=torch.bfloat16)
    e = torch.empty(1, device="cuda")
    from kipp_cuda.kernels.kv_write import _kv_write_op
    from kipp_cuda.kernels.qk_norm_rope import _qk_norm_rope_kv_write_op

    fused = {}
    for T in (1, 256, 8192):
        big = torch.randn(T, 4096, device="cuda", dtype=torch.bfloat16)
        kc = torch.zeros(T // 32 + 2, 32, 8, 128, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        slots = torch.arange(T, device="cuda")
        p = torch.arange(T, device="cuda") % 4096
        a = (big, hw, hw, p, cs, 16, 8, 128, 1e-6)

        def separate(a=a, kc=kc, vc=vc, slots=slots, big=big, T=T):
            q, k = _qk_norm_rope_op(*a)
            _kv_write_op(k, big[:, 3072:].view(T, 8, 128), kc, vc, slots)

        fused[f"qk_norm_rope + kv_write T={T}"] = separate
        fused[f"qk_norm_rope_kv_write T={T}"] = lambda a=a, kc=kc, vc=vc, slots=slots: (
            _qk_norm_rope_kv_write_op(*a, slots, kc, vc)
        )
    for name, fn in {
        **fused,
        "fill_ (empty-ish kernel)": lambda: e.fill_(1.0),
        "rms_norm+res T=1": lambda: _rms_norm_op(x, w, 1e-6, x),
        "qk_norm_rope T=1": lambda: _qk_norm_rope_op(qkv, hw, hw, pos, cs, 16, 8, 128, 1e-6),
        "silu_and_mul T=1": lambda: _silu_and_mul_op(gu),
    }.items():
        us = graph_us(fn)
        print(f"small    {name:26} {us:6.2f} us")
        rows.append({"family": "small", "shape": name, "us": us})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="small,dense,q8_0,affine4")
    p.add_argument("--shapes", default="", help="comma-separated name substrings, e.g. '0.6B,8B '")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--write-configs",
        action="store_true",
        help=f"merge each GEMV shape's fastest config into {TUNED}",
    )
    p.add_argument("--split-k", action="store_true", help="quantized shapes: split_grid only")
    p.add_argument("--wide", action="store_true", help="quantized shapes: the wide tile grid")
    args = p.parse_args()
    global SPLIT_ONLY, WIDE
    SPLIT_ONLY, WIDE = args.split_k, args.wide
    torch.manual_seed(0)
    triton.runtime.driver.active.get_current_device()  # needs a GPU: after --help
    picks = args.shapes.split(",")  # any of these substrings; "" takes every shape
    shapes = {k: v for k, v in SHAPES.items() if any(p in k for p in picks)}
    rows: list = []
    only = args.only.split(",")
    for name, fn in (
        ("small", lambda: small(rows)),
        ("dense", lambda: dense(rows, shapes)),
        ("q8_0", lambda: q8(rows, shapes)),
        ("affine4", lambda: affine4(rows, shapes)),
    ):
        if name in only:
            fn()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1, default=lambda o: math.nan)
    if args.write_configs:
        write_configs(rows)


def write_configs(rows: list) -> None:
    """The fastest config of every swept GEMV shape into the tuned table (kipp_cuda/kernels/
    tuned.py), keyed by family and N x K."""
    with open(TUNED) as f:
        table = json.load(f)
    for r in rows:
        ok = [x for x in r.get("results", []) if "us" in x]
        if r["family"] in ("dense", "q8_0", "affine4") and ok:
            N, K = SHAPES[r["shape"]]
            table.setdefault(r["family"], {})[f"{N}x{K}"] = min(ok, key=lambda x: x["us"])["cfg"]
    with open(TUNED, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote {TUNED}")


if __name__ == "__main__":
    main()
