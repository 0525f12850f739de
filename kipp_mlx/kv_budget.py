"""How many KV blocks to give the engine: an explicit count, a memory budget, or a default."""

from __future__ import annotations

import os

import mlx.core as mx

from kipp_core.backend import BackendOptions
from kipp_core.config import ModelConfig
from kipp_core.kv_memory import parse_kv_memory
from kipp_mlx.kv_cache import PagedKVCache

DEFAULT_CAP = 2 << 30  # the default pool: 4 full contexts, at most 2 GiB (but one context at least)


def device_memory() -> int:
    """The GPU's recommended working set (Metal) or free memory (MLX's CUDA build), else system
    RAM."""
    if mx.default_device() == mx.gpu:
        info = mx.device_info()
        n = (
            info.get("max_recommended_working_set_size")
            or info.get("free_memory")
            or info.get("memory_size")
        )
        if n:
            return int(n)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_kv_blocks(opts: BackendOptions, cfg: ModelConfig, itemsize: int) -> int:
    """`num_blocks`, else `kv_cache_memory` (bytes as "4GiB", or a float in (0, 1]: that fraction
    of device_memory()), else enough for 4 contexts of max_model_len, capped at DEFAULT_CAP."""
    bs = opts.block_size
    per_block = bs * PagedKVCache.bytes_per_token(cfg, itemsize, opts.kv_quant)
    if opts.num_blocks is not None:
        n = opts.num_blocks
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"num_blocks must be a positive integer, got {n!r}")
        return n
    mem = opts.kv_cache_memory
    if mem is not None:
        kind, v = parse_kv_memory(mem)
        budget = int(v * device_memory()) if kind == "fraction" else int(v)
        n = budget // per_block
        if n <= 0:
            raise ValueError(f"kv_cache_memory {mem!r} holds no block of {per_block} bytes")
        return n
    ctx = min(opts.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    ctx_blocks = -(-ctx // bs)
    return max(ctx_blocks, min(4 * ctx_blocks, DEFAULT_CAP // per_block))
