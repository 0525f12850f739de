"""The one-token Q8_0 matmul (decode of one sequence): out [1, N] = x [1, K] @ dequant(qs, d)^T,
a weight-streaming GEMV on CUDA cores (q8_0_matmul.py takes T > 1 and documents the format).

A program owns BLOCK_N rows and walks K in [BLOCK_N, BLOCK_G] tiles whose element (n, g), group g
of row n (8 int32 words and a scale), sits in one thread: two 16-byte asm loads (bits.py), so no
step needs a layout change through shared memory, and a thread's rows share their groups' x. Each
byte becomes an exact fp32 with a shift and a LOP3 (bits.py), without the quarter-rate I2F; each
group's scale applies to its 32-element sum. With INT_X (bf16/fp16 x; the tuned table or
KIPP_CUDA_INT_X), x becomes int16 per group and dp2a multiplies it with the int8 weights directly
(bits.py), about 1.5 instructions a weight against 3.8. The tuned table picks, per shape, whether
the next tile's loads go out before this tile's math (PREFETCH) or more programs share an SM, and
may cap registers (maxnreg); split-K (matmul_tiles.store_tile) when the rows alone leave SMs idle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_core.quant import QK8_0
from kipp_cuda.kernels.bits import (
    aligned_x,
    byte_dot8,
    dot2,
    load_scalar,
    load_words,
    load_x8,
    quant_x16,
    sum8,
)
from kipp_cuda.kernels.head_argmax import check_head, head_out
from kipp_cuda.kernels.matmul_tiles import (
    _TL,
    gemv_launch,
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
def _q8_0_gemv_tile(w_rows, d_rows, g, ASM: tl.constexpr):
    # Group g of each row: its 8 int32 words (32 int8, two 16-byte loads) and fp16 scale.
    w = w_rows + g[None, :] * 8
    a = load_words(w, ASM)
    b = load_words(w + 4, ASM)
    return a + b, load_scalar(d_rows + g[None, :], ASM)


@triton.jit
def _q8_0_gemv_kernel(
    x_ptr,
    qw_ptr,
    d_ptr,
    out_ptr,
    part_ptr,
    lock_ptr,
    key_ptr,
    N,
    num_groups,
    groups_per_split,
    stride_qn,
    stride_dn,
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
):
    # One token (x: [K]). Program (row block, K split); element (n, g) of its [BLOCK_N, BLOCK_G]
    # tile is group g of row n, 8 words and a scale held by one thread, so the math needs no
    # layout change; a thread's elements share groups, so their x is loaded and summed once.
    # Rows past N read row N - 1 and groups past the split read its last group (masked out).
    pdl_trigger(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn, width, rows = tile_rows(pid_n, N, BLOCK_N, SWIGLU)  # SWIGLU: gate, up rows
    rg = tl.arange(0, BLOCK_G)
    w_rows = qw_ptr + rows[:, None] * stride_qn
    d_rows = d_ptr + rows[:, None] * stride_dn
    g_start = pid_k * groups_per_split
    g_end = tl.minimum(g_start + groups_per_split, num_groups)
    if PREFETCH:
        w, d = _q8_0_gemv_tile(w_rows, d_rows, tl.minimum(g_start + rg, g_end - 1), ASM)
    acc = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
    pdl_wait(PDL)  # the first weight tile is in flight; x comes from the previous kernel
    for g0 in range(g_start, g_end, BLOCK_G):
        if PREFETCH:  # the next tile's loads go out before this tile's math: two in flight
            nw, nd = _q8_0_gemv_tile(w_rows, d_rows, tl.minimum(g0 + BLOCK_G + rg, g_end - 1), ASM)
        else:  # one tile in flight a program, more programs an SM (fewer registers)
            w, d = _q8_0_gemv_tile(w_rows, d_rows, tl.minimum(g0 + rg, g_end - 1), ASM)
        g = tl.minimum(g0 + rg, g_end - 1)
        if INT_X:  # x as int16, two dp2a a word (bits.py)
            xq, xs, _ = quant_x16(x_ptr, g * 32, False, ASM)
            dot = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.int32)
            for j in tl.static_range(8):
                dot = dot2(xq[2 * j][None, :], w[j], dot, False, False, ASM)
                dot = dot2(xq[2 * j + 1][None, :], w[j], dot, True, False, ASM)
            part = dot.to(tl.float32) * (d.to(tl.float32) * xs[None, :])
        else:
            xf = tl.zeros([BLOCK_N, BLOCK_G], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_G], dtype=tl.float32)
            for j in tl.static_range(4):  # 8 values of x and 2 words at a time
                x = load_x8(x_ptr, g * 32 + 8 * j, ASM)
                x_sum += sum8(x)
                xf += byte_dot8(w[2 * j], w[2 * j + 1], x, True, ASM)
            # f = 2 + (q + 128) / 128 (bits.py): sum_g(x q) = 128 (sum_g(x f) - 3 sum_g(x)).
            part = (xf - 3.0 * x_sum[None, :]) * (d.to(tl.float32) * 128.0)
        acc += tl.where((g0 + rg < g_end)[None, :], part, 0.0)
        if PREFETCH:
            w, d = nw, nd
    store_row(
        acc, out_ptr, part_ptr, lock_ptr, rn, width, pid_n, pid_k, BLOCK_N, SPLIT_K, SWIGLU,
        HEAD, key_ptr, ROUND,
    )  # fmt: skip


def gemv_config(N: int, num_groups: int, device: torch.device) -> dict:
    """BLOCK_N rows x BLOCK_G groups a K step: 16 x 64 with one tile in flight a program (the
    fastest single config over the 8B shapes, 218.6 us summed against 208.0 for each shape's best:
    benchmarks/LOG.md, entry fe27bc1), 4 rows when N is small. Shapes in the tuned table
    (tools/sweep/kernel_sweep.py) skip this."""
    tuned = None if interpreting() else tuned_config("q8_0", N, num_groups * QK8_0)
    if tuned is not None:
        return tuned
    bn, bg = 16, 64
    if interpreting():  # few, large programs keep the CPU interpreter quick
        bn, bg = 32, 16
    elif triton.cdiv(N, bn) < num_sms(device):
        bn = 4
    bg = min(bg, triton.next_power_of_2(num_groups))
    split = pick_split_k(device, triton.cdiv(N, bn), triton.cdiv(num_groups, bg), 1)
    # (the interpreter keeps the prefetching loop, which the CPU gates then run through)
    return dict(BLOCK_N=bn, BLOCK_G=bg, SPLIT_K=split, num_warps=4, PREFETCH=interpreting())


def q8_0_gemv(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    asm: bool | None = None,
    swiglu: bool = False,
    head_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """The T = 1 launch of q8_0_matmul (checked operands), with an optional explicit config;
    asm=False takes bits.py's integer path on a GPU too (the reference of its LOP3 path). swiglu:
    qs holds gate then up rows, and out [1, N / 2] is their SwiGLU (matmul_tiles.tile_rows).
    head_keys (head_argmax.py): out is fp32 [1, N], the bits of the plain call's .float(), and
    head_keys[0] takes the running argmax key (finish_argmax reads it)."""
    N, K = qs.shape
    check_head(head_keys, x.shape[0], swiglu)
    if head_keys is not None:
        out = head_out(out, N, x)
    elif out is None:
        out = torch.empty((1, N // 2 if swiglu else N), dtype=x.dtype, device=x.device)
    num_groups = K // QK8_0
    cfg = swiglu_config(config or gemv_config(N, num_groups, x.device), swiglu)
    grid, per_split, part, locks = gemv_launch(x.device, N, num_groups, cfg, "BLOCK_G")
    if qs.stride(0) % 16 or qs.data_ptr() % 16:  # the kernel reads rows 16 bytes at a time
        qs = qs.clone()
    x = aligned_x(x)
    pdl = launch_kwargs(x.device)
    _q8_0_gemv_kernel[grid](
        x,
        qs.view(torch.int32),
        d,
        out,
        part,
        locks,
        head_keys,
        N,
        num_groups,
        per_split,
        qs.stride(0) // 4,
        d.stride(0),
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_G=cfg["BLOCK_G"],
        SPLIT_K=cfg["SPLIT_K"],
        PDL=bool(pdl),
        ASM=not interpreting() if asm is None else asm,
        SWIGLU=swiglu,
        HEAD=head_keys is not None,
        ROUND=_TL[x.dtype] if head_keys is not None else None,
        **launch_options(cfg, x.dtype),
        **pdl,
    )
    return out
