"""Rows of a quantized embedding table, dequantized in one launch: out [T, K] in the model's dtype.

The references (`*_embedding_ref`) gather the rows and dequantize them with the matmul files'
fp32 dequantizers (q * d for q8_0; q * scale + bias for affine), then round once to the dtype:
five to ten launches in a decode graph. The kernel does the same arithmetic in one, without FMA
contraction (`enable_fp_fusion=False`), so that q * scale + bias rounds as the reference's separate
product and sum do: the same bits.
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


@triton.jit
def _quant_embedding_kernel(
    ids_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    K,
    stride_w,
    stride_s,
    stride_b,
    stride_o,
    Q8: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (token, column block). w: int8 [V, K] (Q8) or int32 words of 32 / BITS values.
    pdl_trigger(PDL)
    pdl_wait(PDL)  # the ids may come from the kernel before
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < K
    row = tl.load(ids_ptr + t).to(tl.int64)
    scale = tl.load(s_ptr + row * stride_s + cols // GROUP, mask=mask, other=0).to(tl.float32)
    if Q8:
        q = tl.load(w_ptr + row * stride_w + cols, mask=mask, other=0).to(tl.float32)
        val = q * scale
    else:
        PER: tl.constexpr = 32 // BITS
        word = tl.load(w_ptr + row * stride_w + cols // PER, mask=mask, other=0)
        q = (word >> ((cols % PER) * BITS)) & ((1 << BITS) - 1)  # (the mask drops sign bits)
        bias = tl.load(b_ptr + row * stride_b + cols // GROUP, mask=mask, other=0)
        val = q.to(tl.float32) * scale + bias.to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, val.to(out_ptr.dtype.element_ty), mask=mask)


def _check_ids(ids: torch.Tensor) -> None:
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be an integer [T] tensor, got {ids.dtype} {tuple(ids.shape)}")


def _launch(ids, w, s, b, K, dtype, q8: bool, bits: int, group: int) -> torch.Tensor:
    _check_ids(ids)
    out = torch.empty((ids.shape[0], K), dtype=dtype, device=w.device)
    if ids.shape[0] == 0 or K == 0:
        return out
    pdl = launch_kwargs(w.device)
    _quant_embedding_kernel[(ids.shape[0], triton.cdiv(K, BLOCK))](
        ids,
        w,
        s,
        b,
        out,
        K,
        w.stride(0),
        s.stride(0),
        b.stride(0),
        out.stride(0),
        Q8=q8,
        BITS=bits,
        GROUP=group,
        BLOCK=BLOCK,
        PDL=bool(pdl),
        num_warps=4,
        enable_fp_fusion=False,
        **pdl,
    )
    return out


def _q8_0_embedding_op(ids, qs, d, dtype=torch.float32) -> torch.Tensor:
    return _launch(ids, qs, d, d, qs.shape[1], dtype, True, 8, qs.shape[1] // d.shape[1])


def q8_0_embedding_ref(ids, qs, d, dtype=torch.float32) -> torch.Tensor:
    """Rows `ids` [T] of a q8_0 table (qs int8 [V, K], d fp16 [V, K / 32]): [T, K] in dtype."""
    _check_ids(ids)
    return dequantize_q8_0_ref(qs[ids], d[ids]).to(dtype)


def _affine_embedding_op(ids, wq, scales, biases, bits, group_size, dtype=torch.float32):
    K = wq.shape[1] * 32 // bits
    return _launch(ids, wq.view(torch.int32), scales, biases, K, dtype, False, bits, group_size)


def affine_embedding_ref(ids, wq, scales, biases, bits, group_size, dtype=torch.float32):
    """Rows `ids` [T] of an affine table (wq int32 words, scales and biases [V, K / group_size]):
    [T, K] in dtype."""
    _check_ids(ids)
    return dequantize_affine_ref(wq[ids], scales[ids], biases[ids], bits, group_size).to(dtype)


q8_0_embedding = dispatch("q8_0_embedding", _q8_0_embedding_op, q8_0_embedding_ref)
affine_embedding = dispatch("affine_embedding", _affine_embedding_op, affine_embedding_ref)
