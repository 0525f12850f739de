"""Greedy argmax in the vocabulary head's epilogue ("head mode" of the one-token GEMVs).

A batch-1 decode step's lm_head (N = 151,936 rows) would otherwise be followed by three non-PDL
torch launches: `.float()` of the logits and torch.argmax (a memset and a reduce). In head mode
the GEMV (q8_0_gemv, affine_gemv, dense_gemv; matmul_tiles._write) writes the logits as fp32 (the
fp32 sums rounded to x's dtype first: the bits of `gemv(x).float()`) and folds its row block into
a running argmax with one int64 `atomic_max` a program on `keys[row]`; `finish_argmax` (a
one-program PDL kernel) then turns keys[:B] into token ids and re-arms them to KEY_MIN for the
next call.

A key orders as torch.argmax under signed int64 comparison:
- bits 63..32: the value's fp32 bits made order-preserving as a signed int32 (v >= 0: the bits;
  v < 0: bits ^ 0x7FFFFFFF), after -0.0 -> +0.0 (so the two tie) and any NaN -> 0x7FFFFFFF (above
  +inf: like torch.argmax, the first NaN wins);
- bits 31..0: 0xFFFFFFFF - column, so among equal values the lowest column wins.
KEY_MIN (INT64_MIN) is below every key a value makes (its high word would be a negative NaN's,
which is canonicalized away), so columns past N, masked to it, never win.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait

KEY_MIN = -(2**63)
LO_MASK = 0xFFFFFFFF  # the column field
_KEY_MIN = tl.constexpr(KEY_MIN)
_LO = tl.constexpr(LO_MASK)


@triton.jit
def max_keys(vals, cols, N):
    """fp32 vals [M, BLOCK_N] at output columns cols [BLOCK_N] -> [M] int64: each row's largest
    packed key (module docstring), columns >= N left out (KEY_MIN)."""
    v = tl.where(vals == 0.0, 0.0, vals)  # -0.0 ties +0.0
    bits = v.to(tl.int32, bitcast=True)
    bits = tl.where(v != v, 0x7FFFFFFF, bits)  # NaN above +inf
    hi = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    lo = tl.full([], _LO, tl.int64) - cols.to(tl.int64)
    key = (hi << 32) | lo[None, :]
    key = tl.where((cols < N)[None, :], key, _KEY_MIN)
    return tl.max(key, axis=1)


@triton.jit
def _finish_argmax_kernel(keys_ptr, out_ptr, B, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_trigger(PDL)
    pdl_wait(PDL)  # the keys come from the GEMV before
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < B
    key = tl.load(keys_ptr + i, mask=mask, other=0)
    lo_mask = tl.full([], _LO, tl.int64)
    col = lo_mask - (key & lo_mask)
    tl.store(out_ptr + i, col, mask=mask)
    tl.store(keys_ptr + i, tl.full([BLOCK], _KEY_MIN, tl.int64), mask=mask)


def new_argmax_keys(n: int, device) -> torch.Tensor:
    """n armed key slots (int64 KEY_MIN), one a batch row; finish_argmax re-arms what it reads."""
    return torch.full((n,), KEY_MIN, dtype=torch.int64, device=device)


def _check(keys: torch.Tensor, out: torch.Tensor) -> int:
    B = out.numel()
    if keys.dtype != torch.int64 or out.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(
            f"finish_argmax needs int64 keys [n] and out, got {keys.dtype} {tuple(keys.shape)}, "
            f"{out.dtype}"
        )
    if B > keys.numel() or not out.is_contiguous() or not keys.is_contiguous():
        raise ValueError(f"finish_argmax: out ({B}) needs contiguous keys with as many slots")
    return B


def _finish_argmax_op(keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Token ids of keys[:B] into out [B] (int64), and keys[:B] re-armed to KEY_MIN."""
    B = _check(keys, out)
    if B == 0:
        return out
    block = min(1024, triton.next_power_of_2(B))
    pdl = launch_kwargs(keys.device)
    _finish_argmax_kernel[(triton.cdiv(B, block),)](
        keys, out, B, BLOCK=block, PDL=bool(pdl), num_warps=1, **pdl
    )
    return out


def decode_keys(keys: torch.Tensor) -> torch.Tensor:
    """The columns (int64) that packed keys name."""
    return LO_MASK - (keys & LO_MASK)


def finish_argmax_ref(keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    B = _check(keys, out)
    out.copy_(decode_keys(keys[:B]).view(out.shape))
    keys[:B] = KEY_MIN
    return out


finish_argmax = dispatch("finish_argmax", _finish_argmax_op, finish_argmax_ref)


def argmax_keys(logits: torch.Tensor) -> torch.Tensor:
    """Each row's largest packed key of fp32 logits [B, N] (int64 [B]; KEY_MIN where N = 0), in
    torch: max_keys' arithmetic."""
    v = logits.float()
    if v.shape[-1] == 0:
        return torch.full(v.shape[:-1], KEY_MIN, dtype=torch.int64, device=v.device)
    v = torch.where(v == 0, torch.zeros_like(v), v)
    bits = v.contiguous().view(torch.int32)
    bits = torch.where(v.isnan(), torch.full_like(bits, 0x7FFFFFFF), bits)
    hi = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    lo = LO_MASK - torch.arange(v.shape[-1], device=v.device, dtype=torch.int64)
    return ((hi << 32) | lo).amax(dim=-1)


def pack_argmax_ref(logits: torch.Tensor, keys: torch.Tensor) -> None:
    """What a head-mode GEMV does to keys, in torch: keys[:B] = max(keys[:B], argmax_keys)."""
    B = logits.shape[0]
    keys[:B] = torch.maximum(keys[:B], argmax_keys(logits))


def head_ref(out: torch.Tensor, head_keys: torch.Tensor | None) -> torch.Tensor:
    """A head-mode result the torch way, for every path that is not a head-mode GEMV: out as it
    is without head_keys, else out.float() with its argmax folded into head_keys."""
    if head_keys is None:
        return out
    out = out.float()
    pack_argmax_ref(out, head_keys)
    return out


def check_head(head_keys: torch.Tensor | None, T: int, fused: bool = False) -> None:
    """Head mode (head_keys given) takes one token and no SwiGLU (act / swiglu) fusion."""
    if head_keys is None:
        return
    if T != 1:
        raise ValueError(f"head_keys (argmax in the epilogue) needs T = 1, got T = {T}")
    if fused:
        raise ValueError("head_keys cannot be combined with swiglu or act")
    if head_keys.dtype != torch.int64 or head_keys.dim() != 1 or head_keys.numel() < 1:
        raise ValueError(
            f"head_keys must be int64 [n >= 1], got {head_keys.dtype} {tuple(head_keys.shape)}"
        )


def head_out(out: torch.Tensor | None, N: int, x: torch.Tensor) -> torch.Tensor:
    """A head-mode GEMV's output: fp32 [1, N] (given or new)."""
    if out is None:
        return torch.empty((1, N), dtype=torch.float32, device=x.device)
    if out.dtype != torch.float32 or out.shape != (1, N):
        raise ValueError(f"head mode writes fp32 [1, {N}], got out {out.dtype} {tuple(out.shape)}")
    return out
