"""Copy one KV block into another through every layer: a prompt-end hit's tail block.

A KV store is one contiguous tensor whose dimension `block_dim` indexes the blocks
([layers, K/V, blocks, block_size, heads, head_dim] for kv_cache.allocate's stores), viewed here as
[rows, blocks, block_elems]. The block ids come from a device tensor `blocks` = (src, dst), so the
copy can sit in a CUDA graph and take new ids on every replay; src < 0 copies nothing.

torch's own strided copy of the same views splits into one launch per 2^31 elements of the store
(its 32-bit indexing limit): 8 launches over a 16 GiB cache, more over a larger one, each ~9 us of
host time on the prompt-end hit's path. This is one launch, and none inside the head graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch

BLOCK = 4096  # elements a program copies


@triton.jit
def _copy_block_kernel(store_ptr, blocks_ptr, row_stride, block_elems, BLOCK: tl.constexpr):
    # Program (row, chunk of the block); int64 offsets: a store spans more than 2^31 elements.
    src = tl.load(blocks_ptr).to(tl.int64)
    dst = tl.load(blocks_ptr + 1).to(tl.int64)
    if src >= 0:
        row = store_ptr + tl.program_id(0).to(tl.int64) * row_stride
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < block_elems
        x = tl.load(row + src * block_elems + cols, mask=mask)
        tl.store(row + dst * block_elems + cols, x, mask=mask)


def _check(store: torch.Tensor, blocks: torch.Tensor, block_dim: int) -> None:
    if not 0 <= block_dim < store.dim():
        raise ValueError(f"block_dim {block_dim} is not a dimension of a {store.dim()}-d store")
    if blocks.shape != (2,) or blocks.dtype != torch.int64 or blocks.device != store.device:
        raise ValueError(
            f"blocks must be int64 (src, dst) on {store.device}, got {blocks.dtype} "
            f"{tuple(blocks.shape)} on {blocks.device}"
        )


def _copy_block_op(store: torch.Tensor, blocks: torch.Tensor, block_dim: int) -> None:
    _check(store, blocks, block_dim)
    if not store.is_contiguous():
        raise ValueError("copy_block needs a contiguous store")
    rows = math.prod(store.shape[:block_dim])
    elems = math.prod(store.shape[block_dim + 1 :])
    grid = (rows, triton.cdiv(elems, BLOCK))
    _copy_block_kernel[grid](
        store, blocks, store.shape[block_dim] * elems, elems, BLOCK=BLOCK, num_warps=4
    )


def copy_block_ref(store: torch.Tensor, blocks: torch.Tensor, block_dim: int) -> None:
    _check(store, blocks, block_dim)
    src, dst = blocks.tolist()
    if src >= 0:
        store.select(block_dim, dst).copy_(store.select(block_dim, src))


copy_block = dispatch("copy_block", _copy_block_op, copy_block_ref)
