"""Weight-only MLX affine matmul: out [T, N] = x [T, K] @ dequant(wq, scales, biases)^T.

wq: [N, K * bits / 32] uint32 words (held as int32), element j of a row at bits (j % per) * bits of
word j // per, per = 32 / bits (LSB first); scales, biases: [N, K / group_size] in any float dtype;
w = scales * q + biases per group, and scales may be negative. bits 4 or 8, group_size 32/64/128.
Same two kernels as q8_0_matmul (which documents the design): a CUDA-core GEMV for T == 1
(affine_gemv.py), and tl.dot for T > 1 on tiles dequantized to the activation dtype, with split-K
for T <= 16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.affine_gemv import affine_gemv
from kipp_cuda.kernels.head_argmax import check_head, head_ref
from kipp_cuda.kernels.matmul_tiles import (
    dot_dtype,
    split_k_buffers,
    store_tile,
    tile_ids,
)
from kipp_cuda.kernels.q8_0_matmul import _MAGIC, GEMV_MAX_T, matmul_config, rotate
from kipp_cuda.kernels.swiglu import silu_and_mul, silu_and_mul_ref

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _field(w, SHIFT: tl.constexpr, BITS: tl.constexpr):
    # The float with bits 0x4B000000 | u is 2**23 + u exactly for u < 2**23 (no I2F, a
    # quarter-rate pipe): the field at SHIFT as fp32.
    u = ((w >> SHIFT) & ((1 << BITS) - 1)) | _MAGIC
    return u.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def unpack_words(words, BITS: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, W: tl.constexpr):
    """words [D0, D1, W] int32 -> their [D0, D1, W * 32 / BITS] unsigned fields as exact fp32, in
    element order (LSB first); tl.join interleaves them back and keeps each word's values in the
    thread that loaded it."""
    w = words.to(tl.uint32, bitcast=True)
    e0 = _field(w, 0, BITS)
    e1 = _field(w, BITS, BITS)
    e2 = _field(w, 2 * BITS, BITS)
    e3 = _field(w, 3 * BITS, BITS)
    if BITS == 8:
        # join(a, b) adds a last axis [a, b]; flattening index (i1, i0) gives 2 * i1 + i0.
        t = tl.join(tl.join(e0, e2), tl.join(e1, e3))
        return tl.reshape(t, [D0, D1, W * 4])
    else:
        e4 = _field(w, 16, BITS)
        e5 = _field(w, 20, BITS)
        e6 = _field(w, 24, BITS)
        e7 = _field(w, 28, BITS)
        t = tl.join(
            tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7))
        )
        return tl.reshape(t, [D0, D1, W * 8])


@triton.jit(do_not_specialize=["T"])  # the token count changes every step
def _affine_matmul_kernel(
    x_ptr,
    wq_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    lock_ptr,
    T,
    N,
    K,
    k_per_split,
    stride_xt,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_bn,
    stride_bg,
    stride_ot,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    WPG: tl.constexpr = GROUP * BITS // 32
    NG: tl.constexpr = BLOCK_K // GROUP
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = tile_ids(pid, T, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rg = tl.arange(0, NG)
    m_mask = rm < T
    n_mask = rn < N
    rn64 = rn.to(tl.int64)
    # x tile [BLOCK_M, BLOCK_K]; the weight tile is unpacked as [BLOCK_N, NG, GROUP] (K last, as
    # stored), then transposed for the dot.
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xt
    w_rows = wq_ptr + rn64[:, None, None] * stride_wn
    w_off = rg[:, None] * WPG + tl.arange(0, WPG)[None, :]
    s_rows = s_ptr + rn64[:, None] * stride_sn
    b_rows = b_ptr + rn64[:, None] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        g0 = k0 // GROUP
        if EVEN_K:
            x = tl.load(x_rows + rk[None, :], mask=m_mask[:, None], other=0)
            words = tl.load(
                w_rows + g0 * WPG + w_off[None, :, :], mask=n_mask[:, None, None], other=0
            )
            s = tl.load(s_rows + (g0 + rg[None, :]) * stride_sg, mask=n_mask[:, None], other=0)
            b = tl.load(b_rows + (g0 + rg[None, :]) * stride_bg, mask=n_mask[:, None], other=0)
        else:
            k_mask = rk < k_end
            g_mask = (g0 + rg) * GROUP < k_end
            x = tl.load(x_rows + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
            words = tl.load(
                w_rows + g0 * WPG + w_off[None, :, :],
                mask=n_mask[:, None, None] & g_mask[None, :, None],
                other=0,
            )
            sb_mask = n_mask[:, None] & g_mask[None, :]
            s = tl.load(s_rows + (g0 + rg[None, :]) * stride_sg, mask=sb_mask, other=0)
            b = tl.load(b_rows + (g0 + rg[None, :]) * stride_bg, mask=sb_mask, other=0)
        q = unpack_words(words, BITS, BLOCK_N, NG, WPG)
        w = q * s.to(tl.float32)[:, :, None] + b.to(tl.float32)[:, :, None]
        w = tl.reshape(w, [BLOCK_N, BLOCK_K]).to(DOT_DTYPE)
        acc = tl.dot(x.to(DOT_DTYPE), tl.trans(w), acc, input_precision=INPUT_PRECISION)
    tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
    store_tile(
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
        BLOCK_M,
        BLOCK_N,
        SPLIT_K,
    )


# -- host ---------------------------------------------------------------------------------------


def _check(x, wq, scales, biases, bits, group_size, swiglu: bool = False) -> None:
    if swiglu and wq.dim() == 2 and wq.shape[0] % 2:
        raise ValueError(f"swiglu needs gate and up rows (an even N), got wq {tuple(wq.shape)}")
    if bits not in (4, 8) or group_size not in (32, 64, 128):
        raise ValueError(
            f"affine_matmul supports bits 4/8 and group_size 32/64/128, got {bits}/{group_size}"
        )
    if x.dim() != 2 or wq.dim() != 2 or wq.dtype not in (torch.int32, torch.uint32):
        raise ValueError(
            f"affine_matmul needs x [T, K] and wq int32 [N, K * bits / 32], got "
            f"{tuple(x.shape)} and {wq.dtype} {tuple(wq.shape)}"
        )
    N, K = wq.shape[0], x.shape[1]
    if K % group_size or wq.shape[1] * 32 != K * bits:
        raise ValueError(
            f"wq {tuple(wq.shape)} does not hold {K} {bits}-bit values a row (K must "
            f"be divisible by group_size {group_size})"
        )
    for name, t in (("scales", scales), ("biases", biases)):
        if t.shape != (N, K // group_size) or t.dtype not in _FLOAT_DTYPES:
            raise ValueError(
                f"{name} must be float [{N}, {K // group_size}], got {t.dtype} {tuple(t.shape)}"
            )
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")


def _affine_matmul_op(
    x: torch.Tensor,
    wq: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    swiglu: bool = False,
    head_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] @ dequant(wq, scales, biases)^T -> [T, N]; swiglu and head_keys as q8_0_matmul's
    (SwiGLU of gate and up rows, or fp32 logits and an argmax key, in the GEMV's epilogue)."""
    _check(x, wq, scales, biases, bits, group_size, swiglu)
    check_head(head_keys, x.shape[0], swiglu)
    if any(t.stride(1) != 1 for t in (x, wq)):  # scales and biases may be strided (sb views)
        raise ValueError("affine_matmul needs x's and wq's last dimension contiguous")
    if wq.dtype == torch.uint32:
        wq = wq.view(torch.int32)
    T, K = x.shape
    N = wq.shape[0]
    if 0 < T <= GEMV_MAX_T and N and K:
        return affine_gemv(
            x, wq, scales, biases, bits, group_size, swiglu=swiglu, head_keys=head_keys
        )
    out = _affine_product(x, wq, scales, biases, bits, group_size)
    out = head_ref(out, head_keys)  # (N or K = 0)
    return silu_and_mul(out) if swiglu else out


def _affine_product(x, wq, scales, biases, bits: int, group_size: int) -> torch.Tensor:
    T, K = x.shape
    N = wq.shape[0]
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    cfg = matmul_config(T, N, K, x.device, x.dtype, group_size)
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    bk = max(bk, group_size)
    per_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    n_tiles = triton.cdiv(T, bm) * triton.cdiv(N, bn)
    part, locks = split_k_buffers(x.device, n_tiles, split, bm, bn)
    _affine_matmul_kernel[(n_tiles, split)](
        x,
        wq,
        scales,
        biases,
        out,
        part,
        locks,
        T,
        N,
        K,
        per_split,
        x.stride(0),
        wq.stride(0),
        scales.stride(0),
        scales.stride(1),
        biases.stride(0),
        biases.stride(1),
        out.stride(0),
        BITS=bits,
        GROUP=group_size,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=cfg["GROUP_M"],
        SPLIT_K=split,
        EVEN_K=K % bk == 0,
        DOT_DTYPE=dot_dtype(x.dtype),
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def dequantize_affine_ref(wq, scales, biases, bits: int, group_size: int) -> torch.Tensor:
    """fp32 [N, K] weights: s * q + b per group (fp32, like kipp_core.quant)."""
    per = 32 // bits
    w = wq.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=wq.device, dtype=torch.int64) * bits
    q = ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*wq.shape[:-1], -1)
    g = q.float().reshape(*q.shape[:-1], -1, group_size)
    out = g * scales.float()[..., None] + biases.float()[..., None]
    return out.reshape(q.shape)


def affine_matmul_ref(
    x,
    wq,
    scales,
    biases,
    bits: int,
    group_size: int,
    swiglu: bool = False,
    head_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    _check(x, wq, scales, biases, bits, group_size, swiglu)
    check_head(head_keys, x.shape[0], swiglu)
    w = dequantize_affine_ref(wq, scales, biases, bits, group_size)
    out = (x.float() @ w.T).to(x.dtype)
    out = head_ref(out, head_keys)
    return silu_and_mul_ref(out) if swiglu else out


affine_matmul = dispatch("affine_matmul", _affine_matmul_op, affine_matmul_ref)


def bench_specs(device: str = "cuda") -> list[dict]:
    """Qwen3 0.6B and 8B projections from decode to prefill, 4-bit and 8-bit, group 32 with bf16
    scales and biases (as MLX stores them). Weights rotate so that every call streams from HBM."""
    from kipp_cuda.kernels.bench import TOKENS, linear_shapes, rotating

    specs = []
    for bits in (4, 8):
        for model, shapes in linear_shapes().items():
            for proj, (N, K) in shapes.items():
                wbytes = N * K * (bits / 8 + 4 / 32)
                w = [
                    (
                        torch.randint(
                            -(2**31), 2**31, (N, K * bits // 32), dtype=torch.int32, device=device
                        ),
                        torch.randn(N, K // 32, device=device, dtype=torch.bfloat16) / 64,
                        torch.randn(N, K // 32, device=device, dtype=torch.bfloat16) / 64,
                        bits,
                        32,
                    )
                    for _ in range(rotating(wbytes))
                ]
                for T in TOKENS:
                    x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
                    specs.append(
                        {
                            "name": f"affine{bits}_matmul",
                            "kernels": ["affine_matmul"],
                            "shape": f"{model} {proj} T={T} N={N} K={K}",
                            "fn": rotate(affine_matmul, x, w),
                            "ref": rotate(affine_matmul_ref, x, w),
                            "bytes": wbytes + 2 * T * (K + N),
                            "flops": 2 * T * N * K,
                        }
                    )
    return specs
