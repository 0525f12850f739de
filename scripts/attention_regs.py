"""Registers, spills and SASS size of the decode attention kernels at the 8B batch-1 split config:
32 query heads, 8 kv heads, head_dim 128, a bf16 cache of 32-token pages, at a context of 2,100
and as many splits as decode_attention gives a 40,960-token graph on an H200's 132 SMs (the
graph's longest context sets the split count). Compiled for sm_90 offline as Triton specializes
the real launch: the launch is recorded on meta tensors, then each pointer and stride is marked
16-divisible by Triton's own rule on its value (kernels/sass.py compile_launch), with PDL on.
Variants: the two-launch kernel (decode_attention.py) and the fused one (fused_decode.py),
FUSED_PREFETCH_KV on and off.

TRITON_DEFAULT_FP_FUSION=1 python scripts/attention_regs.py [--splits N] [--warps 4] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from kipp_cuda.kernels import decode_attention as dec
from kipp_cuda.kernels import fused_decode as fd
from kipp_cuda.kernels import sass

HQ, HKV, D, PAGE, BLOCKS, MAX_BLOCKS = 32, 8, 128, 32, 4096, 1280  # 40,960-token tables
DEV = "meta"  # no memory; Triton counts a meta tensor's pointer aligned, as a CUDA allocation is


def _record(module, name, run):
    cap = sass.Capture(getattr(module, name))
    setattr(module, name, cap)
    try:
        run()
    finally:
        setattr(module, name, cap.fn)
    return cap


def default_splits(max_model_len: int = 40960, sms: int = 132) -> int:
    real = dec.num_sms
    dec.num_sms = lambda device: sms
    try:
        return dec.num_splits_for(1, HKV, max_model_len, torch.device(DEV))
    finally:
        dec.num_sms = real


def launches(splits: int | None = None, ctx: int = 2100) -> dict:
    splits = splits or default_splits()
    bf16 = dict(dtype=torch.bfloat16, device=DEV)
    kc = torch.empty(BLOCKS, PAGE, HKV, D, **bf16)
    vc = torch.empty_like(kc)
    bt = torch.empty(1, MAX_BLOCKS, dtype=torch.int32, device=DEV)
    lens = torch.empty(1, dtype=torch.int32, device=DEV)
    qkv = torch.empty(1, (HQ + 2 * HKV) * D, **bf16)
    w = torch.empty(D, **bf16)
    pos = torch.empty(1, dtype=torch.int64, device=DEV)
    cos_sin = torch.empty(40960, D, dtype=torch.float32, device=DEV)
    q = torch.empty(1, HQ, D, **bf16)  # qk_norm_rope_kv_write's output, contiguous
    kw = dict(max_context_len=ctx, num_splits=splits)
    out = {}
    out["two-launch"] = _record(
        dec,
        "_paged_decode_attention_kernel",
        lambda: dec._paged_decode_attention_op(q, kc, vc, bt, lens, D**-0.5, **kw),
    )
    was = fd.FUSED_PREFETCH_KV
    for prefetch in (True, False):
        fd.FUSED_PREFETCH_KV = prefetch
        out[f"fused prefetch={int(prefetch)}"] = _record(
            fd,
            "_fused_decode_kernel",
            lambda: fd._paged_decode_attention_qkv_op(
                qkv, w, w, pos, cos_sin, HQ, 1e-6, pos, kc, vc, bt, lens, D**-0.5, **kw
            ),
        )
    fd.FUSED_PREFETCH_KV = was
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--splits", type=int, help="default: an 8B graph's on an H200")
    p.add_argument("--warps", type=int, help="NUM_WARPS_SPLIT (default: the module's)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.warps:
        dec.NUM_WARPS_SPLIT = args.warps
    rows = {}
    splits = args.splits or default_splits()
    for name, cap in launches(splits).items():
        rows[name] = sass.resources(sass.compile_launch(cap, PDL=True))
    if args.json:
        print(json.dumps(rows))
        return
    print(f"8B batch 1, {splits} splits, {dec.NUM_WARPS_SPLIT} warps, sm_90")
    print("| kernel | registers | stack bytes | spill stores | SASS instructions |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        cells = (r["regs"], r["stack"], r["spill_stores"], r["instructions"])
        print(f"| {name} | " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
