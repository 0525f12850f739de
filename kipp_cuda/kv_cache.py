"""The paged KV cache in device memory, sized from an explicit budget."""

from __future__ import annotations

import logging

import torch

from kipp_core.config import ModelConfig
from kipp_core.kv_budget import KVBudget, serving_budget
from kipp_core.kv_memory import parse_kv_memory
from kipp_cuda.attention import LayerKV
from kipp_cuda.kernels.block_copy import copy_block as copy_store_block

log = logging.getLogger("kipp")

DEFAULT_FRACTION = 0.3  # of free memory after weights: a 0.6B model never takes the whole card
DEFAULT_CAP = 16 * 2**30
# The default grows to one full-context request where that fits in this much of free memory: an
# 8B context of 131,072 tokens (YaRN) is 18 GiB of bf16 KV, more than the cap
FULL_CONTEXT_FRACTION = 0.9


def bytes_per_block(
    cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_quant: str | None, tp_size: int = 1
) -> int:
    elems = 2 * cfg.num_hidden_layers * block_size * (cfg.num_key_value_heads // tp_size)
    elems *= cfg.head_dim
    if kv_quant == "q8_0":
        return elems + elems // 32 * 2  # int8 values + one fp16 scale per 32
    return elems * torch.tensor([], dtype=dtype).element_size()


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks_for(
    budget,
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    kv_quant: str | None,
    device: torch.device,
    tp_size: int = 1,
    sizing: str = "offline",
    max_num_seqs: int = 256,
    max_model_len: int | None = None,
    min_tokens: int = 0,
) -> KVBudget:
    """The pool for the user's budget; else the serving default (kipp_core.kv_budget) with
    sizing "serving", or the modest offline one: DEFAULT_FRACTION of free memory, at most
    DEFAULT_CAP (on a CPU device: 4 contexts of max_model_len, at most 2 GiB), raised to hold
    `min_tokens` (one full-context request) where FULL_CONTEXT_FRACTION of free memory allows."""
    per = bytes_per_block(cfg, block_size, dtype, kv_quant, tp_size)
    free = free_memory(device)
    if budget is not None:
        kind, v = parse_kv_memory(budget)
        nbytes = v * free if kind == "fraction" else v
        if nbytes > free:
            raise ValueError(
                f"KV budget of {nbytes / 2**30:.2f} GiB exceeds the "
                f"{free / 2**30:.2f} GiB free on {device}"
            )
        n = max(1, int(nbytes // per))
        asked = f"{v:g} of the {free / 2**30:.1f} GiB free" if kind == "fraction" else budget
        return KVBudget(n, n * per, f"kv_cache_memory {asked}")
    if sizing == "serving":
        max_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        return serving_budget(int(free), per, block_size, max_num_seqs, max_len)
    if sizing != "offline":
        raise ValueError(f"kv_sizing must be 'offline' or 'serving', got {sizing!r}")
    cap = DEFAULT_CAP
    if device.type != "cuda":  # as the MLX backend's default: 4 full contexts, at most 2 GiB
        ctx = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        cap = min(2 * 2**30, 4 * -(-ctx // block_size) * per)
    nbytes = min(DEFAULT_FRACTION * free, cap)
    why = (
        f"offline default: {DEFAULT_FRACTION:.0%} of the {free / 2**30:.1f} GiB free, "
        f"at most {cap / 2**30:.2g} GiB"
    )
    need = -(-min_tokens // block_size) * per
    if nbytes < need <= FULL_CONTEXT_FRACTION * free:
        nbytes = need
        why = f"offline default, raised to one context of {min_tokens:,} tokens"
    n = max(1, int(nbytes // per))
    return KVBudget(n, n * per, why)


def allocate(
    cfg: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    kv_quant: str | None,
    device: torch.device,
    tp_size: int = 1,
) -> list[LayerKV]:
    if kv_quant not in (None, "q8_0"):
        raise ValueError(f"kv_quant must be None or 'q8_0', got {kv_quant!r}")
    if kv_quant and cfg.head_dim % 32:
        raise ValueError(f"q8_0 KV needs head_dim divisible by 32, got {cfg.head_dim}")
    # One tensor a kind, [layers, K/V, blocks, ...], each layer's K and V views of it, so that
    # copying a block through every layer (copy_block) is one launch.
    L = cfg.num_hidden_layers
    shape = (num_blocks, block_size, cfg.num_key_value_heads // tp_size, cfg.head_dim)
    if kv_quant == "q8_0":
        qs = torch.zeros((L, 2, *shape), dtype=torch.int8, device=device)
        sc = torch.zeros(
            (L, 2, *shape[:-1], cfg.head_dim // 32), dtype=torch.float16, device=device
        )
        return [LayerKV(qs[i, 0], qs[i, 1], sc[i, 0], sc[i, 1]) for i in range(L)]
    kv = torch.zeros((L, 2, *shape), dtype=dtype, device=device)
    return [LayerKV(kv[i, 0], kv[i, 1]) for i in range(L)]


def stores(caches: list[LayerKV]) -> list[tuple[torch.Tensor, int]]:
    """(tensor, its block dimension) for every tensor that holds the caches' blocks: allocate's
    [layers, 2, blocks, ...] stores, or each layer's own tensors when built another way."""
    out: dict[int, tuple[torch.Tensor, int]] = {}
    for kv in caches:
        for t in (kv.k, kv.v, kv.k_scale, kv.v_scale):
            if t is None:
                continue
            base = t._base
            if base is not None and base.dim() == t.dim() + 2 and base.shape[3:] == t.shape[1:]:
                out[id(base)] = (base, 2)
            else:
                out[id(t)] = (t, 0)
    return list(out.values())


def copy_block(stores_: list[tuple[torch.Tensor, int]], blocks: torch.Tensor) -> None:
    """Block src's K/V (and scales) into block dst, in every layer; `blocks` is (src, dst), int64
    on the device (src < 0: nothing), so that a CUDA graph can hold the copy."""
    for t, dim in stores_:
        copy_store_block(t, blocks, dim)
