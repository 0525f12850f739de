"""Rows of an embedding table in one launch: out [T, K] in the model's dtype, from a dense table or
a quantized one (dequantized in the kernel).

The references (`*_embedding_ref`) gather the rows and dequantize them with the matmul files'
fp32 dequantizers (q * d for q8_0; q * scale + bias for affine), then round once to the dtype:
five to ten launches in a decode graph. The kernel does the same arithmetic in one, without FMA
contraction (`enable_fp_fusion=False`), so that q * scale + bias rounds as the reference's separate
product and sum do: the same bits.

`take_last=(flags, last)`: row t looks up last[t] where flags[t] != 0, else ids[t]. A decode
graph's steady state takes its PENDING ids from the last step's argmax this way, in the embedding
launch itself rather than in a compare and a select, two more launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.affine_matmul import dequantize_affine_ref
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait
from kipp_cuda.kernels.q8_0_matmul import dequantize_q8_0_ref

BLOCK = 1024  # values of a row a program writes
DENSE, Q8, AFFINE = range(3)  # table kinds


@triton.jit
def _embedding_kernel(
    ids_ptr,
    flags_ptr,
    last_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    K,
    stride_w,
    stride_s,
    stride_sg,
    stride_b,
    stride_bg,
    stride_o,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    TAKE_LAST: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, column block). w: [V, K] in the model's dtype (DENSE), int8 [V, K] (Q8),
    # or int32 words of 32 / BITS values (AFFINE).
    pdl_trigger(PDL)
    pdl_wait(PDL)  # the ids may come from the kernel before
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    row = tl.load(ids_ptr + t).to(tl.int64)
    if TAKE_LAST:
        row = tl.where(tl.load(flags_ptr + t) != 0, tl.load(last_ptr + t).to(tl.int64), row)
    if KIND == 0:
        val = tl.load(w_ptr + row * stride_w + cols, mask=mask, other=0)
    else:
        scale = tl.load(s_ptr + row * stride_s + cols // GROUP * stride_sg, mask=mask, other=0)
        if KIND == 1:
            q = tl.load(w_ptr + row * stride_w + cols, mask=mask, other=0).to(tl.float32)
            val = q * scale.to(tl.float32)
        else:
            PER: tl.constexpr = 32 // BITS
            word = tl.load(w_ptr + row * stride_w + cols // PER, mask=mask, other=0)
            q = (word >> ((cols % PER) * BITS)) & ((1 << BITS) - 1)  # (the mask drops sign bits)
            bias = tl.load(b_ptr + row * stride_b + cols // GROUP * stride_bg, mask=mask, other=0)
            val = q.to(tl.float32) * scale.to(tl.float32) + bias.to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, val.to(out_ptr.dtype.element_ty), mask=mask)


def _check(ids: torch.Tensor, take_last) -> None:
    """ids [T] integer; take_last's flags and last integer, at least T long."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be an integer [T] tensor, got {ids.dtype} {tuple(ids.shape)}")
    for name, t in (
        () if take_last is None else zip(("take_last flags", "take_last ids"), take_last)
    ):
        if t.dim() != 1 or t.shape[0] < ids.shape[0] or t.dtype.is_floating_point:
            raise ValueError(f"{name} must be an integer [>= T] tensor, got {t.dtype} {t.shape}")


def take_last_ids(ids: torch.Tensor, take_last) -> torch.Tensor:
    """ids with take_last applied, in torch (the references' way, and the vocabulary-parallel
    embedding's)."""
    _check(ids, take_last)
    if take_last is None:
        return ids
    flags, last = take_last
    n = ids.shape[0]
    return torch.where(flags[:n] != 0, last[:n].to(ids.dtype), ids)


def _launch(ids, w, s, b, K, dtype, kind: int, bits: int, group: int, take_last) -> torch.Tensor:
    _check(ids, take_last)
    out = torch.empty((ids.shape[0], K), dtype=dtype, device=w.device)
    if ids.shape[0] == 0 or K == 0:
        return out
    flags, last = take_last if take_last is not None else (ids, ids)
    pdl = launch_kwargs(w.device)
    _embedding_kernel[(ids.shape[0], triton.cdiv(K, BLOCK))](
        ids,
        flags,
        last,
        w,
        s,
        b,
        out,
        K,
        w.stride(0),
        s.stride(0),
        s.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        KIND=kind,
        BITS=bits,
        GROUP=group,
        BLOCK=BLOCK,
        TAKE_LAST=take_last is not None,
        PDL=bool(pdl),
        num_warps=4,
        enable_fp_fusion=False,
        **pdl,
    )
    return out


def _dense_embedding_op(ids, w, dtype=None, take_last=None) -> torch.Tensor:
    if w.stride(1) != 1:
        w = w.contiguous()
    return _launch(ids, w, w, w, w.shape[1], dtype or w.dtype, DENSE, 16, 1, take_last)


def dense_embedding_ref(ids, w, dtype=None, take_last=None) -> torch.Tensor:
    """Rows `ids` [T] of a dense table w [V, K]: [T, K] in dtype (w's by default)."""
    ids = take_last_ids(ids, take_last)
    return torch.nn.functional.embedding(ids, w).to(dtype or w.dtype)


def _q8_0_embedding_op(ids, qs, d, dtype=torch.float32, take_last=None) -> torch.Tensor:
    group = qs.shape[1] // d.shape[1]
    return _launch(ids, qs, d, d, qs.shape[1], dtype, Q8, 8, group, take_last)


def q8_0_embedding_ref(ids, qs, d, dtype=torch.float32, take_last=None) -> torch.Tensor:
    """Rows `ids` [T] of a q8_0 table (qs int8 [V, K], d fp16 [V, K / 32]): [T, K] in dtype."""
    ids = take_last_ids(ids, take_last)
    return dequantize_q8_0_ref(qs[ids], d[ids]).to(dtype)


def _affine_embedding_op(
    ids, wq, scales, biases, bits, group_size, dtype=torch.float32, take_last=None
):
    K = wq.shape[1] * 32 // bits
    w = wq.view(torch.int32)
    return _launch(ids, w, scales, biases, K, dtype, AFFINE, bits, group_size, take_last)


def affine_embedding_ref(
    ids, wq, scales, biases, bits, group_size, dtype=torch.float32, take_last=None
):
    """Rows `ids` [T] of an affine table (wq int32 words, scales and biases [V, K / group_size]):
    [T, K] in dtype."""
    ids = take_last_ids(ids, take_last)
    return dequantize_affine_ref(wq[ids], scales[ids], biases[ids], bits, group_size).to(dtype)


dense_embedding = dispatch("dense_embedding", _dense_embedding_op, dense_embedding_ref)
q8_0_embedding = dispatch("q8_0_embedding", _q8_0_embedding_op, q8_0_embedding_ref)
affine_embedding = dispatch("affine_embedding", _affine_embedding_op, affine_embedding_ref)
