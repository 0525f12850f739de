"""Launch configs measured per shape (vLLM's tuned-config files): `configs/h200_gemv.json` holds the
fastest config of each Qwen3 decode GEMV shape from tools/sweep/kernel_sweep.py on an H200 (its
"source" field names the records of the sweeps). Shapes not in the table (tensor-parallel shards,
other models) use each kernel's heuristic.

KIPP_CUDA_TUNED=family/NxK/KEY=v/KEY=v... replaces the named keys of one shape's config, for
sweeps inside the whole decode graph (tools/sweep/step_ablation.py `env:` variants), where a tile's
cost includes what overlaps it; for example affine4/24576x4096/BLOCK_N=16/num_warps=8. Several
shapes' overrides join with ';' (tools/sweep/pick_tiles.py combines a sweep's winners so)."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    return json.loads((Path(__file__).parent / "configs" / "h200_gemv.json").read_text())


def tuned_config(family: str, N: int, K: int) -> dict | None:
    """The measured config of a `family` ("dense", "q8_0", "affine4") GEMV of w [N, K], or None."""
    cfg = _table().get(family, {}).get(f"{N}x{K}")
    override = _overrides(os.environ.get("KIPP_CUDA_TUNED", "")).get((family, f"{N}x{K}"))
    if override:
        return {**(cfg or {}), **override}
    return dict(cfg) if cfg else None


@functools.lru_cache(maxsize=4)
def _overrides(env: str) -> dict[tuple[str, str], dict]:
    """KIPP_CUDA_TUNED parsed once per value (tuned_config runs at every GEMV launch)."""
    out: dict[tuple[str, str], dict] = {}
    for override in filter(None, env.split(";")):
        fam, shape, *pairs = override.split("/")
        values = out.setdefault((fam, shape), {})
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not value.lstrip("-").isdigit():
                raise ValueError(f"KIPP_CUDA_TUNED: {pair!r} in {override!r} is not KEY=integer")
            values[key] = int(value)
    return out
