"""What each kind of small kernel costs a batch-1 decode step, launch gaps included: the decode
graph replayed back to back with one kind of kernel left out at a time (its output replaced by a
view of its input, so the logits are wrong by design). The difference to the full graph is what
fusing that kernel away could save at most.

  full      the model as it runs
  norm      no RMSNorm launches (input, post-attention, final)
  act       no separate SwiGLU launch (none is left at batch 1: the GEMVs fuse it)
  attn      no decode attention (and no split merge)
  qkv       no q/k norm + RoPE + KV write
  gemv      none of the four above: the GEMVs alone
  da:A=v;B=w   the full model with decode_attention's module settings A, B changed (for example
            da:PREFETCH_KV=0;MIN_TILES_PER_SPLIT=1), to compare attention variants in the step
  set:M.A=v;M.B=w   the same for module settings of any kipp_cuda.kernels module M (for example
            set:rms_norm.MAX_ROW_WARPS=8;qk_norm_rope.BLOCK_HEADS=4)
  env:NAME=v   the graph captured with environment variable NAME set to v (for example
            env:KIPP_CUDA_PDL=0); join variants with '+' (gemv+env:KIPP_CUDA_PDL=0)

A variant that fails to build or run is reported and left out of the table (a tile sweep may
name configs a kernel refuses). --json writes {quant: {variant: ms}} for tools/sweep/pick_tiles.py.

python tools/sweep/step_ablation.py --shape qwen3-8b --quant q8_0 --context 2100
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os

import torch

import kipp_cuda.layers as layers
import kipp_cuda.model as model_mod
import kipp_cuda.tp_reduce as tp_reduce
from kipp_core.backend import BackendOptions
from kipp_core.checkpoint import Checkpoint
from kipp_core.tiny import random_checkpoint
from kipp_cuda.backend import ShardBackend


def _no_norm(x, w, eps, residual=None):
    return x if residual is None else (x, residual)


def _no_act(x):
    return x[:, : x.shape[1] // 2]


def _no_attn(q, kv, meta, scale):
    return q


def _no_qkv(qkv, layer, kv, meta, positions, cos_sin):
    d = layer.head_dim
    return qkv[:, : layer.num_heads * d].view(qkv.shape[0], layer.num_heads, d)


PATCHES = {
    "norm": [(tp_reduce, "rms_norm", _no_norm)],
    "act": [(layers, "silu_and_mul", _no_act)],
    "attn": [(model_mod, "attention", _no_attn)],
    "qkv": [(model_mod, "store_qkv", _no_qkv)],
}
PATCHES["gemv"] = [p for v in PATCHES.values() for p in v]


def _patches(name):
    if name.startswith("da:"):  # decode_attention's module settings
        name = "set:" + ";".join(f"decode_attention.{kv}" for kv in name[3:].split(";"))
    if name.startswith("set:"):  # kernel module settings, ints
        out = []
        for kv in name[4:].split(";"):
            path, v = kv.split("=")
            mod, attr = path.rsplit(".", 1)
            out.append((importlib.import_module(f"kipp_cuda.kernels.{mod}"), attr, int(v)))
        return out
    return PATCHES.get(name, [])


@contextlib.contextmanager
def patched(name):
    parts = name.split("+")
    env = dict(p[4:].split("=", 1) for p in parts if p.startswith("env:"))
    patches = [x for p in parts if not p.startswith("env:") for x in _patches(p)]
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    saved_env = {k: os.environ.get(k) for k in env}
    for m, a, f in patches:
        setattr(m, a, f)
    os.environ.update(env)
    try:
        yield
    finally:
        for m, a, f in saved:
            setattr(m, a, f)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def step_ms(runner, device, steps):
    fn = runner._graph_fn("decode", 1)
    fn()
    g, _ = runner._capture(fn, None)
    for _ in range(5):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        g.replay()
    b.record()
    torch.cuda.synchronize(device)
    del g
    return a.elapsed_time(b) / steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--quants", default="none,q8_0,affine4")
    p.add_argument(
        "--variants",
        default="full,norm,act,attn,qkv,gemv",
        help="comma-separated; da: variants separate settings with ';'",
    )
    p.add_argument("--context", type=int, default=2100)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=1)
    p.add_argument("--json", help="write the step times here")
    args = p.parse_args()
    path = random_checkpoint(args.shape)
    device = torch.device("cuda")
    rows = []
    for quant in args.quants.split(","):
        q = None if quant == "none" else quant
        opts = BackendOptions(
            kv_cache_memory=args.kv_cache_memory,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            quant=q,
        )
        shard = ShardBackend(Checkpoint(path), opts, device)
        runner = shard.runner
        # the context on its own blocks: with a zero block table attention reads block 0 from L2,
        # 0.02-0.03 ms a step too cheap (benchmarks/LOG.md, entry 5de113c)
        runner.inputs.stage_one_sequence(args.context, runner.block_size)
        times = {}
        for v in args.variants.split(","):
            try:
                with patched(v):
                    times[v] = step_ms(runner, device, args.steps)
            except Exception as e:  # noqa: BLE001 - a refused config; the sweep goes on
                print(f"{quant} {v}: failed: {type(e).__name__}: {str(e)[:200]}")
                torch.cuda.synchronize(device)
        rows.append((quant, times))
        runner.graphs.clear()
        del shard, runner
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({quant: t for quant, t in rows}, f, indent=1)
    names = [n for n in args.variants.split(",") if all(n in t for _, t in rows)]
    print(f"{args.shape}, batch-1 decode graph, context {args.context}, {args.steps} replays")
    print("| quant | " + " | ".join(f"{n} ms" for n in names) + " | saved without each |")
    print("|---|" + "---|" * len(names) + "---|")
    for quant, t in rows:
        saved = ", ".join(f"{n} {t['full'] - t[n]:.3f}" for n in names if n != "full")
        print(f"| {quant} | " + " | ".join(f"{t[n]:.3f}" for n in names) + f" | {saved} |")


if __name__ == "__main__":
    main()
