"""The one-token MLX affine matmul (decode of one sequence): out [1, N] = x [1, K] @ dequant(wq,
scales, biases)^T, the CUDA-core GEMV of q8_0_gemv.py for affine_matmul.py's formats.

Per group, sum(x w) = s sum(x q) + b sum(x). sum(x q) comes from dp2a on int16 x (INT_X, group
size 32; bits.py), or exactly in fp32 with q made exact fp32 by bits.py (a shift and a LOP3 a
value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels.bits import (
    aligned_x,
    byte_dot8,
    dot2,
    load_scalar,
    load_words,
    load_x8,
    nibble_floats,
    quant_x16,
    split_halves,
    sum8,
)
from kipp_cuda.kernels.head_argmax import check_head, head_out
from kipp_cuda.kernels.matmul_tiles import (
    _TL,
    gemv_launch,
    gemv_rows,
    interpreting,
    launch_options,
    num_sms,
    pick_split_k,
    store_row,
    swiglu_config,
    tile_rows,
)
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait
from kipp_cuda.kernels.tuned import tuned_config


@triton.jit
def _affine_gemv_tile(
    w_rows, s_rows, b_rows, g, stride_sg, stride_bg, WPG: tl.constexpr, PACKED: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    # Group g of each row: its WPG int32 words (16-byte loads), scale and bias; PACKED: s_rows
    # points at int32 words holding (scale, bias), one load for both.
    w = w_rows + g[None, :] * WPG
    words = load_words(w, ASM)
    for i in tl.static_range(1, WPG // 4):
        words = words + load_words(w + 4 * i, ASM)
    if PACKED:  # (one return: Triton types every return of a function alike)
        s, b = split_halves(load_scalar(s_rows + g[None, :], ASM), PACKED == 2)
    else:
        s = load_scalar(s_rows + g[None, :] * stride_sg, ASM).to(tl.float32)
        b = load_scalar(b_rows + g[None, :] * stride_bg, ASM).to(tl.float32)
    return words, s, b


@triton.jit
def _affine_gemv_step(
    x_ptr, w, s, b, g0, rg, g_end, BITS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, WPG: tl.constexpr, INT_X: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    # One K step's [BLOCK_N, BLOCK_G] group sums of the tile (w, s, b) of groups g0.., zero
    # past g_end. Per group, sum(x w) = s sum(x q) + b sum(x); sum(x q) from dp2a on int16 x
    # (INT_X, group size 32) or exact in fp32.
    g = tl.minimum(g0 + rg, g_end - 1)
    if INT_X and GROUP == 32:  # x as int16, dp2a on the weights' bytes (bits.py)
        xq, xs, x_sum = quant_x16(x_ptr, g * 32, BITS == 4, ASM)
        dot = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
        if BITS == 4:
            # Even nibbles as bytes n, odd ones masked in place as bytes 16 n (no shift):
            # pairs 4c, 4c + 1 meet the first, 4c + 2, 4c + 3 the second, summed apart.
            dot16 = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
            for c in tl.static_range(WPG):
                lo = w[c] & 0x0F0F0F0F
                hi = w[c] & -252645136  # 0xF0F0F0F0
                dot = dot2(xq[4 * c][None, :], lo, dot, False, True, ASM)
                dot = dot2(xq[4 * c + 1][None, :], lo, dot, True, True, ASM)
                dot16 = dot2(xq[4 * c + 2][None, :], hi, dot16, False, True, ASM)
                dot16 = dot2(xq[4 * c + 3][None, :], hi, dot16, True, True, ASM)
            xq_s = (dot * 16 + dot16).to(tl.float32) * (xs * 0.0625)[None, :]
        else:
            for c in tl.static_range(WPG):
                dot = dot2(xq[2 * c][None, :], w[c], dot, False, True, ASM)
                dot = dot2(xq[2 * c + 1][None, :], w[c], dot, True, True, ASM)
            xq_s = dot.to(tl.float32) * xs[None, :]
        part = xq_s * s.to(tl.float32) + x_sum[None, :] * b.to(tl.float32)
        part = tl.where((g0 + rg < g_end)[None, :], part, 0.0)
    else:
        part = _affine_fp32_group(
            x_ptr, w, s, b, g, g0, rg, g_end, BITS, GROUP, BLOCK_N, BLOCK_G, ASM
        )
    return part


@triton.jit
def _affine_gemv_kernel(
    x_ptr,
    wq_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    part_ptr,
    lock_ptr,
    key_ptr,
    N,
    num_groups,
    groups_per_split,
    stride_wn,
    stride_sn,
    stride_sg,
    stride_bn,
    stride_bg,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,
    PREFETCH: tl.constexpr,
    INT_X: tl.constexpr,
    SWIGLU: tl.constexpr,
    HEAD: tl.constexpr,
    ROUND: tl.constexpr,
    PACKED: tl.constexpr,
):
    # One token (x: [K]). The tile layout of q8_0_gemv.py: element (n, g) is group g of
    # row n (WPG words, a scale and a bias) in one thread. PREFETCH: matmul_tiles.launch_options.
    pdl_trigger(PDL)
    WPG: tl.constexpr = GROUP * BITS // 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn, width, rows = tile_rows(pid_n, N, BLOCK_N, SWIGLU)  # SWIGLU: gate, up rows
    rg = tl.arange(0, BLOCK_G)
    w_rows = wq_ptr + rows[:, None] * stride_wn
    s_rows = s_ptr + rows[:, None] * stride_sn
    b_rows = b_ptr + rows[:, None] * stride_bn
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, num_groups)
    if PREFETCH:
        w, s, b = _affine_gemv_tile(
            w_rows, s_rows, b_rows, tl.minimum(g_start + rg, g_end - 1), stride_sg, stride_bg,
            WPG, PACKED, ASM,
        )  # fmt: skip
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    pdl_wait(PDL)  # the first weight tile is in flight; x comes from the previous kernel
    g_first = g_start
    if PREFETCH == 2:  # EARLY: the first step, peeled, on the tile loaded before the wait
        acc += _affine_gemv_step(
            x_ptr, w, s, b, g_start, rg, g_end, BITS, GROUP, BLOCK_N, BLOCK_G, WPG, INT_X, ASM
        )  # fmt: skip
        g_first = g_start + BLOCK_G
    for g0 in range(g_first, g_end, BLOCK_G):
        if PREFETCH == 1:  # the next tile's loads go out before this tile's math: two in flight
            nw, ns, nb = _affine_gemv_tile(
                w_rows, s_rows, b_rows, tl.minimum(g0 + BLOCK_G + rg, g_end - 1), stride_sg,
                stride_bg, WPG, PACKED, ASM,
            )  # fmt: skip
        else:  # one tile in flight a program, more programs an SM (fewer registers)
            w, s, b = _affine_gemv_tile(
                w_rows, s_rows, b_rows, tl.minimum(g0 + rg, g_end - 1), stride_sg, stride_bg,
                WPG, PACKED, ASM,
            )  # fmt: skip
        acc += _affine_gemv_step(
            x_ptr, w, s, b, g0, rg, g_end, BITS, GROUP, BLOCK_N, BLOCK_G, WPG, INT_X, ASM
        )  # fmt: skip
        if PREFETCH == 1:
            w, s, b = nw, ns, nb
    store_row(
        acc, out_ptr, part_ptr, lock_ptr, rn, width, pid_n, pid_k, BLOCK_N, SPLIT_K, SWIGLU,
        HEAD, key_ptr, ROUND,
    )  # fmt: skip


@triton.jit
def _affine_fp32_group(
    x_ptr,
    w,
    s,
    b,
    g,
    g0,
    rg,
    g_end,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ASM: tl.constexpr,
):
    # The exact fp32 path (fp32 x, group sizes 64 and 128): one K step's [BLOCK_N, BLOCK_G] group
    # sums, zero past g_end. With bits.py's f (2 + q / 128, or 2 + q / 8 for odd nibbles, whose
    # x is taken / 16): sum(x q) = 128 (sum(x f) - 2 sum(x')), x' the x so scaled.
    xf = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    x_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
    x_scaled = tl.zeros([BLOCK_G], dtype=tl.float32)
    for c in tl.static_range(GROUP // 8):  # 8 values of x at a time
        x = load_x8(x_ptr, g * GROUP + 8 * c, ASM)
        if BITS == 4:  # one word: nibbles 2c..2c+7 of the group
            f = nibble_floats(w[c], ASM)
            x1, x3, x5, x7 = x[1] * 0.0625, x[3] * 0.0625, x[5] * 0.0625, x[7] * 0.0625
            x_even = (x[0] + x[2]) + (x[4] + x[6])
            x_odd = (x1 + x3) + (x5 + x7)  # taken / 16
            x_sum += x_even + 16.0 * x_odd
            x_scaled += x_even + x_odd
            xf += (
                f[0] * x[0][None, :]
                + f[1] * x1[None, :]
                + f[2] * x[2][None, :]
                + f[3] * x3[None, :]
                + f[4] * x[4][None, :]
                + f[5] * x5[None, :]
                + f[6] * x[6][None, :]
                + f[7] * x7[None, :]
            )
        else:  # two words of four bytes
            x_sum += sum8(x)
            xf += byte_dot8(w[2 * c], w[2 * c + 1], x, False, ASM)
    if BITS == 8:
        x_scaled = x_sum
    xq = (xf - 2.0 * x_scaled[None, :]) * 128.0
    part = xq * s.to(tl.float32) + x_sum[None, :] * b.to(tl.float32)
    return tl.where((g0 + rg < g_end)[None, :], part, 0.0)


def gemv_config(
    N: int, num_groups: int, group_size: int, device: torch.device, bits: int = 4
) -> dict:
    """BLOCK_N rows x BLOCK_G groups a K step: 16 rows x 1 KB of each row's words (64 groups of
    32 at 4 bits) with one tile in flight a program, the fastest single config over the 8B shapes
    (168.9 us summed against 155.0 for each shape's best; benchmarks/LOG.md, entry fe27bc1); 4
    rows when N is small. Tuned shapes (tools/sweep/kernel_sweep.py, group size 32) skip this."""
    tuned = None if interpreting() else tuned_config(f"affine{bits}", N, num_groups * group_size)
    if tuned is not None and group_size == 32:
        return tuned
    bn, bg = 16, 1024 // (group_size * bits // 8)
    if interpreting():  # few, large programs keep the CPU interpreter quick
        bn, bg = gemv_rows(N, device), 16
    elif triton.cdiv(N, bn) < num_sms(device):
        bn = 4
    bg = min(bg, triton.next_power_of_2(num_groups))
    split = pick_split_k(device, triton.cdiv(N, bn), triton.cdiv(num_groups, bg), 1)
    # (the interpreter keeps the prefetching loop, which the CPU gates then run through)
    return dict(BLOCK_N=bn, BLOCK_G=bg, SPLIT_K=split, num_warps=4, PREFETCH=interpreting())


def scale_bias_operands(scales: torch.Tensor, biases: torch.Tensor):
    """The GEMV's scale and bias operands and PACKED: where they are the two halves of one
    interleaved 16-bit buffer (quant.interleave_scale_bias), one int32 view of it (PACKED 2 for
    bf16, 1 for fp16); otherwise the two tensors as they are (0)."""
    pair = (
        scales.element_size() == 2
        and scales.dtype == biases.dtype
        and scales.stride() == biases.stride()
        and scales.stride(1) == 2
        and scales.stride(0) % 2 == 0
        and biases.data_ptr() == scales.data_ptr() + 2
        and scales.data_ptr() % 4 == 0
    )
    if not pair:
        return scales, biases, 0
    N, G = scales.shape
    words = scales.as_strided((N, G, 2), (scales.stride(0), 2, 1)).view(torch.int32)[..., 0]
    return words, words, 2 if scales.dtype == torch.bfloat16 else 1


def affine_gemv(
    x,
    wq,
    scales,
    biases,
    bits: int,
    group_size: int,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    asm: bool | None = None,
    swiglu: bool = False,
    head_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """The T = 1 launch of affine_matmul (checked operands), with an optional explicit config;
    asm=False takes bits.py's integer path on a GPU too (the reference of its LOP3 path). swiglu:
    wq holds gate then up rows, and out [1, N / 2] is their SwiGLU (matmul_tiles.tile_rows).
    head_keys: fp32 logits and the running argmax key, as q8_0_gemv's."""
    N, K = wq.shape[0], x.shape[1]
    check_head(head_keys, x.shape[0], swiglu)
    if head_keys is not None:
        out = head_out(out, N, x)
    elif out is None:
        out = torch.empty((1, N // 2 if swiglu else N), dtype=x.dtype, device=x.device)
    num_groups = K // group_size
    cfg = swiglu_config(config or gemv_config(N, num_groups, group_size, x.device, bits), swiglu)
    x = aligned_x(x)
    if wq.stride(0) % 4 or wq.data_ptr() % 16:  # the kernel reads rows 16 bytes at a time
        wq = wq.clone()
    grid, per_split, part, locks = gemv_launch(x.device, N, num_groups, cfg, "BLOCK_G")
    pdl = launch_kwargs(x.device)
    s, b, packed = scale_bias_operands(scales, biases)
    _affine_gemv_kernel[grid](
        x,
        wq,
        s,
        b,
        out,
        part,
        locks,
        head_keys,
        N,
        num_groups,
        per_split,
        wq.stride(0),
        s.stride(0),
        s.stride(1),
        b.stride(0),
        b.stride(1),
        BITS=bits,
        GROUP=group_size,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_G=cfg["BLOCK_G"],
        SPLIT_K=cfg["SPLIT_K"],
        PDL=bool(pdl),
        ASM=not interpreting() if asm is None else asm,
        SWIGLU=swiglu,
        HEAD=head_keys is not None,
        ROUND=_TL[x.dtype] if head_keys is not None else None,
        PACKED=packed,
        **launch_options(cfg, x.dtype),
        **pdl,
    )
    return out
