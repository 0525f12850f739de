"""Tiling, split-K and launch helpers shared by the matmul kernels (q8_0_matmul, affine_matmul,
dense_gemv)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels.head_argmax import max_keys

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def store_tile(
    acc,
    out_ptr,
    part_ptr,
    lock_ptr,
    rm,
    rn,
    T,
    N,
    stride_ot,
    tile,
    pid_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr = False,
    HEAD: tl.constexpr = False,
    key_ptr=None,
    ROUND: tl.constexpr = None,
):
    """Write an fp32 [BLOCK_M, BLOCK_N] tile of out (rows rm, columns rn). With SPLIT_K > 1 each
    split stores its partial; the last to arrive sums all SPLIT_K in order and writes out. SWIGLU
    (one row): the tile is BLOCK_N / 2 gate sums then their up sums, written as SwiGLU (_write).
    HEAD (head_argmax.py): out is fp32, the sums are rounded through ROUND (x's dtype) and each
    row's best packed key is atomic_max'ed into key_ptr[row], once a tile."""
    if SPLIT_K == 1:
        _write(acc, out_ptr, rm, rn, T, N, stride_ot, BLOCK_N, SWIGLU, HEAD, key_ptr, ROUND)
    else:
        # part: [num_tiles, SPLIT_K, BLOCK_M, BLOCK_N] fp32; lock: one zeroed int32 per tile.
        offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile_part = part_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        tl.store(tile_part + pid_k * (BLOCK_M * BLOCK_N) + offs, acc)
        tl.debug_barrier()  # every thread's partial is written before the release below
        count = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if count == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: read through L2; this SM's L1 may hold a stale copy from an earlier call.
                total += tl.load(tile_part + s * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
            _write(total, out_ptr, rm, rn, T, N, stride_ot, BLOCK_N, SWIGLU, HEAD, key_ptr, ROUND)
            tl.atomic_xchg(lock_ptr + tile, 0)  # re-armed for the next call


@triton.jit
def _write(
    tile,
    out_ptr,
    rm,
    rn,
    T,
    N,
    stride_ot,
    BLOCK_N: tl.constexpr,
    SWIGLU: tl.constexpr,
    HEAD: tl.constexpr,
    key_ptr,
    ROUND: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    if SWIGLU:
        # [1, BLOCK_N] -> (gate, up) [BLOCK_N / 2] each, both at output columns rn's halves;
        # rounded to the output dtype first and then as silu_and_mul (swiglu.py): the same bits
        # as the GEMV's output taken through that kernel
        pairs = tl.trans(tl.reshape(tile.to(dtype).to(tl.float32), (2, BLOCK_N // 2)))
        g, u = tl.split(pairs)
        cols, _ = tl.split(tl.trans(tl.reshape(rn, (2, BLOCK_N // 2))))
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + cols, y.to(dtype), mask=cols < N)
    else:
        mask = (rm < T)[:, None] & (rn < N)[None, :]
        out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_ot + rn[None, :]
        if HEAD:  # fp32 out holding the bits of the dtype's output .float(); a key a row
            vals = tile.to(ROUND).to(tl.float32)
            tl.store(out_ptrs, vals, mask=mask)
            tl.atomic_max(key_ptr + rm, max_keys(vals, rn, N), mask=rm < T, sem="relaxed")
        else:
            tl.store(out_ptrs, tile.to(dtype), mask=mask)


@triton.jit
def store_row(
    acc,
    out_ptr,
    part_ptr,
    lock_ptr,
    rn,
    N,
    pid_n,
    pid_k,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWIGLU: tl.constexpr = False,
    HEAD: tl.constexpr = False,
    key_ptr=None,
    ROUND: tl.constexpr = None,
):
    """A one-token GEMV's [BLOCK_N, K step] fp32 products summed over K into out's row block rn
    (store_tile's split-K protocol with one row; SWIGLU and HEAD as there, rn and N from
    tile_rows)."""
    out = tl.sum(acc, axis=1)[None, :]
    store_tile(
        out, out_ptr, part_ptr, lock_ptr, tl.arange(0, 1), rn, 1, N, 0, pid_n, pid_k, 1,
        BLOCK_N, SPLIT_K, SWIGLU, HEAD, key_ptr, ROUND,
    )  # fmt: skip


@triton.jit
def tile_rows(pid_n, N, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """(output columns, width of out, weight rows as int64) of a one-token GEMV program's BLOCK_N
    tile rows, rows past the end clamped to the last. SWIGLU (SwiGLU on the output; N = 2 I rows,
    gate then up): tile rows j < BLOCK_N / 2 are gate rows c + j and the rest their up rows
    I + c + j, both halves naming output columns c + j of the I-wide out."""
    j = tl.arange(0, BLOCK_N)
    if SWIGLU:
        half: tl.constexpr = BLOCK_N // 2
        width = N // 2
        cols = pid_n * half + j % half
        rows = tl.minimum(cols, width - 1) + tl.where(j < half, 0, width)
    else:
        width = N
        cols = pid_n * BLOCK_N + j
        rows = tl.minimum(cols, N - 1)
    return cols, width, rows.to(tl.int64)


@triton.jit
def tile_ids(pid, T, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering: GROUP_M row tiles walk the columns together, so weight tiles are reused
    from L2 while they are hot."""
    num_m = tl.cdiv(T, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m, pid_n


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_LOCKS: dict[torch.device, list[torch.Tensor]] = {}


def split_k_buffers(device: torch.device, num_tiles: int, split_k: int, block_m: int, block_n: int):
    """(partials, locks) for a split-K launch. The locks persist zeroed between calls (the last
    program of each tile re-arms its own), one set a device: split-K launches must not run
    concurrently on two streams. The first call allocates them, so make it before CUDA-graph
    capture (the runner's warm-up does); buffers are never freed, as a graph may hold them."""
    if split_k == 1:
        return None, None
    held = _LOCKS.setdefault(device, [])
    if not held or held[-1].numel() < num_tiles:
        held.append(
            torch.zeros(
                max(4096, triton.next_power_of_2(num_tiles)), dtype=torch.int32, device=device
            )
        )
    locks = held[-1]
    part = torch.empty(num_tiles * split_k * block_m * block_n, dtype=torch.float32, device=device)
    return part, locks


def gemv_launch(device: torch.device, N: int, k_units: int, cfg: dict, unit_key: str):
    """Grid, per-split length and split-K buffers of a one-token GEMV whose K is walked in
    cfg[unit_key]-sized steps of `k_units` units (elements or quantization groups)."""
    bn, bk, split = cfg["BLOCK_N"], cfg[unit_key], cfg["SPLIT_K"]
    n_tiles = triton.cdiv(N, bn)
    per_split = triton.cdiv(triton.cdiv(k_units, bk), split) * bk
    part, locks = split_k_buffers(device, n_tiles, split, 1, bn)
    return (n_tiles, split), per_split, part, locks


def swiglu_config(cfg: dict, swiglu: bool) -> dict:
    """A GEMV config for SwiGLU on the output (tile_rows): a tile needs a gate and an up row."""
    return {**cfg, "BLOCK_N": 2} if swiglu and cfg["BLOCK_N"] < 2 else cfg


def int_x(cfg: dict, x_dtype: torch.dtype) -> bool:
    """Whether a quantized GEMV takes x as int16 with integer dot products (bits.py): where its
    config says so (the tuned table, from a sweep that timed both paths; off by default), or
    everywhere with KIPP_CUDA_INT_X=1 and nowhere with 0; never for fp32 x, which keeps the exact
    fp32 path for gating."""
    forced = os.environ.get("KIPP_CUDA_INT_X", "")
    on = cfg.get("INT_X", False) if forced not in ("0", "1") else forced == "1"
    return on and x_dtype != torch.float32


def launch_options(cfg: dict, x_dtype: torch.dtype) -> dict:
    """A quantized GEMV config's launch options: PREFETCH (1 or True: the first K step's loads
    before the PDL wait and each next step's in flight during this one's math, the default; 0:
    one step's loads at a time, all after the wait; 2, affine only: the first step's before the
    wait, then one at a time), INT_X (int_x), num_warps, and maxnreg where the tuned table caps
    registers."""
    opts = dict(
        PREFETCH=int(cfg.get("PREFETCH", True)),
        INT_X=int_x(cfg, x_dtype),
        num_warps=cfg["num_warps"],
    )
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    return opts


def gemv_rows(N: int, device: torch.device) -> int:
    """Rows a GEMV program owns: 8, or 4 when that leaves fewer programs than SMs."""
    if interpreting():  # few, large programs keep the CPU interpreter quick
        return 32
    return 8 if triton.cdiv(N, 8) >= num_sms(device) else 4


def pick_split_k(
    device: torch.device, num_tiles: int, num_k_blocks: int, min_blocks_per_split: int = 4
) -> int:
    """A power of two that brings the programs to about two per SM, keeping each split at least
    `min_blocks_per_split` K blocks long."""
    split = 1
    target = 2 * num_sms(device)
    while (
        num_tiles * split * 2 <= target
        and num_k_blocks // (split * 2) >= min_blocks_per_split
        and split < 16
    ):
        split *= 2
    return split


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(dtype: torch.dtype):
    """What tl.dot multiplies: the activation dtype, except fp32 for bf16 under the interpreter
    (its bf16 arithmetic is broken)."""
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return _TL[dtype]
