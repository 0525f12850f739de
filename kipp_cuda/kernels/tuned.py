"""Launch configs measured per shape (vLLM's tuned-config files): `configs/h200_gemv.json` holds the
fastest config of each Qwen3 decode GEMV shape from scripts/kernel_sweep.py on an H200. Shapes not
in the table (tensor-parallel shards, other models) use each kernel's heuristic."""

from __future__ import annotations

import functools
import json
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    return json.loads((Path(__file__).parent / "configs" / "h200_gemv.json").read_text())


def tuned_config(family: str, N: int, K: int) -> dict | None:
    """The measured config of a `family` ("dense", "q8_0", "affine4") GEMV of w [N, K], or None."""
    cfg = _table().get(family, {}).get(f"{N}x{K}")
    return dict(cfg) if cfg else None
