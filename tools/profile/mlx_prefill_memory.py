"""Peak memory and time of one 512-row prefill query chunk's attention on MLX: SDPA (every score
of the call held at once where MLX does not fuse it) against kipp_mlx.prefill_attention's key
tiles, at the contexts given. Random bf16 inputs; prints one JSON line a (keys, path)."""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

from kipp_mlx import prefill_attention as pa


def measure(heads: int, kv_heads: int, rows: int, keys: int, tiled: bool) -> dict:
    q = mx.random.normal((1, heads, rows, 128)).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, keys, 128)).astype(mx.bfloat16)
    v = mx.random.normal((1, kv_heads, keys, 128)).astype(mx.bfloat16)
    mx.eval(q, k, v)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t = time.perf_counter()
    if tiled:
        o = pa.tiled_attention(q, k, v, 128**-0.5, max(1, pa.SCORE_TILE // (heads * rows)))
    else:
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=128**-0.5, mask="causal")
    mx.eval(o)
    return {
        "device": str(mx.default_device()),
        "heads": heads,
        "kv_heads": kv_heads,
        "rows": rows,
        "keys": keys,
        "path": "tiled" if tiled else "sdpa",
        "score_tile": pa.SCORE_TILE,
        "peak_mib": round((mx.get_peak_memory() - base) / 2**20),
        "seconds": round(time.perf_counter() - t, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--keys", default="32768,131072")
    a = ap.parse_args()
    for keys in map(int, a.keys.split(",")):
        for tiled in (False, True):
            print(json.dumps(measure(a.heads, a.kv_heads, a.rows, keys, tiled)), flush=True)


if __name__ == "__main__":
    main()
