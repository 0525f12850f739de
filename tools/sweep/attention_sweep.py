"""Sweep paged decode attention's launch settings, timed inside CUDA graphs as the GEMVs are
(kernel_sweep.py): at batch 1 per merge variant, first-tile prefetch and warp count over a grid of
split lengths and counts (`--only attn`), and at batch 256 over tile size, warps, pipelining depth
and prefetch (`--only attn_b256`); paged prefill attention over long contexts (8B heads,
16,384-query chunks as `--max-num-batched-tokens 16384` cuts a long prompt) over tile shape, warps
and pipelining depth (`--only prefill`). Prints the default and the best; `--json` keeps every row.

python tools/sweep/attention_sweep.py [--only attn,attn_b256,prefill] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from functools import partial

import torch
import triton
from kernel_sweep import timed

import kipp_cuda.kernels.decode_attention as da
import kipp_cuda.kernels.prefill_attention as pa

QUICK = False  # --quick: batch 1 at the default split count only


def attn(rows):
    """Decode attention at batch 1 in a graph made for max_model_len 40960 (as the runner's), per
    variant of the merge (fused into the attention kernel, or a merge kernel after it), of whether
    the first K/V tile is loaded before the PDL wait, and of num_warps: the default split count,
    then the best and worst of a grid of split lengths and counts."""
    saved = {k: getattr(da, k) for k in ("MIN_TILES_PER_SPLIT", "PREFETCH_KV", "NUM_WARPS")}
    try:
        for model, (hq, hkv) in {"0.6B": (16, 8), "8B": (32, 8)}.items():
            for ctx in (2048, 8192):
                _attn_shape(rows, model, hq, hkv, ctx, saved["MIN_TILES_PER_SPLIT"])
    finally:
        for k, v in saved.items():
            setattr(da, k, v)


def _attn_shape(rows, model: str, hq: int, hkv: int, ctx: int, default_min_tiles: int) -> None:
    page, D = 32, 128
    nb = ctx // page
    kc = torch.randn(nb, page, hkv, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb, device="cuda").to(torch.int32)[None]
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    q = torch.randn(1, hq, D, dtype=torch.bfloat16, device="cuda")
    a = (q, kc, vc, bt, lens, D**-0.5)
    ref = da.paged_decode_attention_ref(*a).float()
    nbytes = 2 * ctx * hkv * D * 2
    grid = [(default_min_tiles, None)]  # the default: num_splits_for's count
    if not QUICK:
        grid += itertools.product((1, 2, 4), (8, 16, 32, 64, 128))
    for fused, prefetch, warps in itertools.product((False, True), (True, False), (2, 4, 8)):
        merge = "fused" if fused else "unfused"
        da.PREFETCH_KV, da.NUM_WARPS = prefetch, warps
        results = []
        for min_tiles, splits in grid:
            da.MIN_TILES_PER_SPLIT = min_tiles
            cfg = {
                "merge": merge,
                "prefetch": prefetch,
                "num_warps": warps,
                "MIN_TILES": min_tiles,
                "splits": splits,
            }
            run = partial(
                da._paged_decode_attention_op,
                *a,
                max_context_len=40960,
                num_splits=splits,
                fused_merge=fused,
            )
            results.append(timed(cfg, run, ref, nbytes))
        d = results[0]
        ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"]) or [
            {"us": math.nan, "gbs": 0, "cfg": None}
        ]
        print(
            f"attn     {model} ctx {ctx:5} {merge:7} prefetch={int(prefetch)} warps={warps} "
            f"default {d.get('us', math.nan):7.2f} us {d.get('gbs', 0):6.0f} GB/s; "
            f"best {ok[0]['us']:7.2f} us {ok[0]['gbs']:6.0f} GB/s {ok[0]['cfg']}; "
            f"worst {ok[-1]['us']:.2f}" + (f"; error {d['error']}" if "error" in d else "")
        )
        rows.append(
            {
                "family": "attn",
                "shape": f"{model} ctx {ctx} {merge} prefetch={prefetch} warps={warps}",
                "bytes": nbytes,
                "results": results,
            }
        )


def attn_batch(rows):
    """Decode attention at batch 256 (the throughput regime): 0.6B heads, contexts drawn from 200
    to 1,500 tokens, each sequence on its own shuffled blocks, one split. Times every tile size,
    warp count, pipelining depth and first-tile prefetch; bytes are the KV read."""
    saved = {k: getattr(da, k) for k in ("BLOCK_N", "PREFETCH_KV", "NUM_WARPS", "NUM_STAGES")}
    page, D, hq, hkv, B = 32, 128, 16, 8, 256
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(200, 1501, (B,), generator=gen)
    per_seq = (int(lens.max()) + page - 1) // page
    nb = B * per_seq
    kc = torch.randn(nb, page, hkv, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb, device="cuda").to(torch.int32).view(B, per_seq)
    ctx = lens.to(torch.int32).cuda()
    q = torch.randn(B, hq, D, dtype=torch.bfloat16, device="cuda")
    a = (q, kc, vc, bt, ctx, D**-0.5)
    ref = da.paged_decode_attention_ref(*a).float()
    nbytes = int(lens.sum()) * hkv * D * 2 * 2
    results = []
    try:
        for block_n, warps, stages, prefetch in itertools.product(
            (32, 64, 128), (2, 4, 8), (1, 2, 3), (True, False)
        ):
            da.BLOCK_N, da.NUM_WARPS, da.NUM_STAGES, da.PREFETCH_KV = (
                block_n,
                warps,
                stages,
                prefetch,
            )
            cfg = {
                "BLOCK_N": block_n,
                "num_warps": warps,
                "num_stages": stages,
                "prefetch": prefetch,
            }
            run = partial(da._paged_decode_attention_op, *a, max_context_len=1500)
            results.append(timed(cfg, run, ref, nbytes, reps=5, iters=5))
    finally:
        for k, v in saved.items():
            setattr(da, k, v)
    default = next(
        r
        for r in results
        if r["cfg"]
        == {
            "BLOCK_N": saved["BLOCK_N"],
            "num_warps": saved["NUM_WARPS"],
            "num_stages": saved["NUM_STAGES"],
            "prefetch": saved["PREFETCH_KV"],
        }
    )
    ok = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    print(
        f"attn_b256 0.6B heads, {nbytes / 1e9:.2f} GB of KV: default "
        f"{default.get('us', math.nan):8.1f} us {default.get('gbs', 0):6.0f} GB/s"
    )
    for r in ok[:5]:
        print(f"{'':24} best {r['us']:8.1f} us {r['gbs']:6.0f} GB/s {r['cfg']}")
    rows.append(
        {
            "family": "attn_b256",
            "shape": "0.6B B=256 ctx 200-1500",
            "bytes": nbytes,
            "results": results,
        }
    )


def prefill(rows):
    """Paged prefill attention, 8B heads: a 2,048-token prompt, and the last 16,384-query chunk of
    32,768- and 131,072-token prompts (the chunks a long prefill spends most of its time in), on
    shuffled 32-token pages. Each config is checked against the default config's output (the
    default is checked against the reference in the GPU tests) and timed by CUDA events, median
    of 3 calls (a long call is 10-100 ms: graphs add nothing)."""
    page, D, hq, hkv = 32, 128, 32, 8
    saved = pa.prefill_config
    grid = [
        {"BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": st}
        for m, n, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    ]
    try:
        for q_len, ctx in ((2048, 2048), (16384, 32768), (16384, 131072)):
            nb = ctx // page
            kc = torch.randn(nb, page, hkv, D, dtype=torch.bfloat16, device="cuda")
            vc = torch.randn_like(kc)
            bt = torch.randperm(nb, device="cuda").to(torch.int32)[None]
            lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
            cu = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
            q = torch.randn(q_len, hq, D, dtype=torch.bfloat16, device="cuda")
            a = (q, kc, vc, bt, cu, lens, D**-0.5, q_len)
            default = saved(q_len, hq // hkv, q.dtype)
            ref = pa._paged_prefill_attention_op(*a).float()
            flops = 4 * D * hq * (q_len * (ctx - q_len) + q_len * (q_len + 1) // 2)
            results = []
            for cfg in [default, *grid]:
                full = {**cfg, "BLOCK_Q": cfg["BLOCK_M"] // (hq // hkv)}
                pa.prefill_config = lambda *_, c=full: c
                results.append(_event_timed(cfg, partial(pa._paged_prefill_attention_op, *a), ref))
                pa.prefill_config = saved
            ok = sorted((r for r in results if "ms" in r), key=lambda r: r["ms"])
            d = results[0]
            shape = f"8B q {q_len} ctx {ctx}"
            print(
                f"prefill  {shape}: default {d.get('ms', math.nan):8.3f} ms "
                f"{flops / d.get('ms', math.nan) / 1e9:6.0f} TFLOP/s {d['cfg']}"
            )
            for r in ok[:4]:
                tf = flops / r["ms"] / 1e9
                print(f"{'':9} best {r['ms']:8.3f} ms {tf:6.0f} TFLOP/s {r['cfg']}")
            rows.append({"family": "prefill", "shape": shape, "flops": flops, "results": results})
            del kc, vc, q, ref
            torch.cuda.empty_cache()
    finally:
        pa.prefill_config = saved


def _event_timed(cfg: dict, fn, ref: torch.Tensor, calls: int = 3) -> dict:
    try:
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        if not err < 2e-2:
            raise AssertionError(f"wrong result, rel err {err:.2e}")
        times = []
        for _ in range(calls):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
    except Exception as e:  # noqa: BLE001 - a failing config is reported, not fatal
        return {"cfg": cfg, "error": str(e)[:120]}
    return {"cfg": cfg, "ms": sorted(times)[len(times) // 2], "all_ms": times}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="attn")
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="attn: only the default split count")
    args = p.parse_args()
    global QUICK
    QUICK = args.quick
    torch.manual_seed(0)
    triton.runtime.driver.active.get_current_device()  # needs a GPU: after --help
    rows: list = []
    only = args.only.split(",")
    for name, fn in (("attn", attn), ("attn_b256", attn_batch), ("prefill", prefill)):
        if name in only:
            fn(rows)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1, default=lambda o: math.nan)


if __name__ == "__main__":
    main()
