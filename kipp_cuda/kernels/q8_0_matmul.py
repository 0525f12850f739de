"""Weight-only Q8_0 matmul: out [T, N] = x [T, K] @ dequant(qs, d)^T, dequantizing in the kernel.

qs: int8 [N, K]; d: fp16 [N, K / 32]; w[n, k] = qs[n, k] * d[n, k // 32] (ggml q8_0). Accumulation
is fp32; the output has x's dtype. Two kernels, chosen by T:
- T == 1 (decode of one sequence): `_q8_0_gemv_kernel`, a weight-streaming GEMV on CUDA cores. A
  program owns BLOCK_N rows and walks K in [BLOCK_N, BLOCK_G] tiles whose element (n, g), group g
  of row n (8 int32 words and a scale), sits in one thread: two 16-byte asm loads (bits.py), so
  no step needs a layout change through shared memory, and a thread's rows share their groups'
  x. Each byte becomes an exact fp32 with a shift and a LOP3 (bits.py); each group's scale
  applies to its 32-element sum. The tuned table picks, per shape, whether the next tile's loads
  go out before this tile's math (PREFETCH) or more programs share an SM, and may cap registers
  (maxnreg); split-K when the rows alone leave SMs idle. With INT_X (bf16/fp16 x; the tuned
  table or KIPP_CUDA_INT_X), x becomes int16 per group and dp2a multiplies it with the int8
  weights directly (bits.py), about 1.5 instructions a weight against 3.8.
- T > 1: `_q8_0_matmul_kernel`, tl.dot on tiles dequantized to the activation dtype (bf16 rounding
  of w, like bf16 weights). For T <= 16 a 16-row tile with split-K keeps the weights streaming
  (tensor cores make 2..16 tokens cost what one does); for prefill, 64/128/256-row tiles with
  grouped ordering for L2 reuse.
Split-K partials are summed in a fixed order by the last program of each tile (a per-tile counter
taken with an acq_rel atomic), so results are deterministic and need no second launch.
Neither kernel converts with the quarter-rate I2F: the tl.dot kernel goes through the float bits
of 2**23 (int8_to_float), the GEMV through bits.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
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
from kipp_cuda.kernels.matmul_tiles import (
    _TL,
    dot_dtype,
    gemv_launch,
    interpreting,
    launch_options,
    num_sms,
    pick_split_k,
    split_k_buffers,
    store_tile,
    tile_ids,
)
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait
from kipp_cuda.kernels.tuned import tuned_config

QK8_0 = 32
GEMV_MAX_T = 1  # larger T goes to the tl.dot kernel (16-row tiles up to T = 16)
SKINNY_MAX_T = 16
_MAGIC = tl.constexpr(0x4B000000)  # the float bits of 2**23


# -- kernels ------------------------------------------------------------------------------------


@triton.jit
def int8_to_float(b):
    # Without I2F (a quarter-rate pipe): the byte with its sign bit flipped is u = q + 128 in
    # [0, 255], and the float with bits 0x4B000000 | u is 2**23 + u exactly.
    u = b.to(tl.uint8, bitcast=True).to(tl.int32) ^ (_MAGIC | 0x80)
    return u.to(tl.float32, bitcast=True) - 8388736.0  # 2**23 + 128


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
):
    # One token (x: [K]). Program (row block, K split); element (n, g) of its [BLOCK_N, BLOCK_G]
    # tile is group g of row n, 8 words and a scale held by one thread, so the math needs no
    # layout change; a thread's elements share groups, so their x is loaded and summed once.
    # Rows past N read row N - 1 and groups past the split read its last group (masked out).
    pdl_trigger(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rg = tl.arange(0, BLOCK_G)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
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
    out = tl.sum(acc, axis=1)[None, :]
    store_tile(
        out,
        out_ptr,
        part_ptr,
        lock_ptr,
        tl.arange(0, 1),
        rn,
        1,
        N,
        0,
        pid_n,
        pid_k,
        1,
        BLOCK_N,
        SPLIT_K,
    )


@triton.jit(do_not_specialize=["T"])  # the token count changes every step
def _q8_0_matmul_kernel(
    x_ptr,
    qs_ptr,
    d_ptr,
    out_ptr,
    part_ptr,
    lock_ptr,
    T,
    N,
    K,
    k_per_split,
    stride_xt,
    stride_qn,
    stride_dn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = tile_ids(pid, T, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    NG: tl.constexpr = BLOCK_K // 32
    rg = tl.arange(0, NG)
    re = tl.arange(0, 32)
    m_mask = rm < T
    n_mask = rn < N
    # x tile [BLOCK_M, BLOCK_K]; weight tile as [NG, 32, BLOCK_N] (k-major, so its K axis meets
    # the dot's), scales [NG, 1, BLOCK_N].
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xt
    qs_cols = qs_ptr + rn.to(tl.int64)[None, None, :] * stride_qn
    d_cols = d_ptr + rn.to(tl.int64)[None, :] * stride_dn
    kw = rg[:, None, None] * 32 + re[None, :, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + rk[None, :], mask=m_mask[:, None], other=0)
            b = tl.load(qs_cols + k0 + kw, mask=n_mask[None, None, :], other=0)
            d = tl.load(d_cols + k0 // 32 + rg[:, None], mask=n_mask[None, :], other=0)
        else:
            k_mask = rk < k_end
            g_mask = k0 + rg * 32 < k_end
            x = tl.load(x_rows + rk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
            b = tl.load(
                qs_cols + k0 + kw, mask=n_mask[None, None, :] & g_mask[:, None, None], other=0
            )
            d = tl.load(
                d_cols + k0 // 32 + rg[:, None], mask=n_mask[None, :] & g_mask[:, None], other=0
            )
        w = int8_to_float(b) * d.to(tl.float32)[:, None, :]
        w = tl.reshape(w, [BLOCK_K, BLOCK_N]).to(DOT_DTYPE)
        acc = tl.dot(x.to(DOT_DTYPE), w, acc, input_precision=INPUT_PRECISION)
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


def _check(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> None:
    if x.dim() != 2 or qs.dim() != 2 or x.shape[1] != qs.shape[1]:
        raise ValueError(
            f"q8_0_matmul needs x [T, K] and qs [N, K], got {tuple(x.shape)} and {tuple(qs.shape)}"
        )
    N, K = qs.shape
    if K % QK8_0 or qs.dtype != torch.int8:
        raise ValueError(
            f"qs must be int8 [N, K] with K divisible by 32, got {qs.dtype} {tuple(qs.shape)}"
        )
    if d.shape != (N, K // QK8_0) or d.dtype != torch.float16:
        raise ValueError(f"d must be float16 [{N}, {K // QK8_0}], got {d.dtype} {tuple(d.shape)}")
    if x.dtype not in _TL:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")


def matmul_config(
    T: int, N: int, K: int, device: torch.device, dtype: torch.dtype, group_size: int = QK8_0
) -> dict:
    """Tile sizes for the tl.dot kernel (register counts checked with ptxas for sm_90: no spills
    in bf16/fp16)."""
    if interpreting():  # small tiles keep the CPU interpreter quick
        cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=1)
    elif dtype == torch.float32:  # exact fp32 FMA dots, for tests and fp32 runs, not speed
        cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=2)
    elif T <= SKINNY_MAX_T:
        # Weight-bound: 32 rows x 256 values a K step (8 KB of q8_0), tokens padded to 16 rows,
        # ~130-190 registers so that several programs share an SM.
        cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4)
    elif T <= 64:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    elif T <= 512 or group_size > 64:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    else:
        # 256 rows share each dequantized weight tile: the dequantization (~9 instructions a
        # weight) then issues in about half the time the tensor cores take for the tile.
        cfg = dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    num_tiles = triton.cdiv(T, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    split = 1
    if T <= SKINNY_MAX_T:
        split = pick_split_k(device, num_tiles, triton.cdiv(K, cfg["BLOCK_K"]))
    cfg["SPLIT_K"] = split
    return cfg


def gemv_rows(N: int, device: torch.device) -> int:
    """Rows a GEMV program owns: 8, or 4 when that leaves fewer programs than SMs."""
    if interpreting():  # few, large programs keep the CPU interpreter quick
        return 32
    return 8 if triton.cdiv(N, 8) >= num_sms(device) else 4


def gemv_config(N: int, num_groups: int, device: torch.device) -> dict:
    """BLOCK_N rows x BLOCK_G groups a K step: 16 x 64 with one tile in flight a program (the
    fastest single config over the 8B shapes in the sixth session's sweep, 218.6 us summed
    against 208.0 for each shape's best), 4 rows when N is small. Shapes in the tuned table
    (scripts/kernel_sweep.py) skip this."""
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
) -> torch.Tensor:
    """The T = 1 launch of q8_0_matmul (checked operands), with an optional explicit config;
    asm=False takes bits.py's integer path on a GPU too (the reference of its LOP3 path)."""
    N, K = qs.shape
    if out is None:
        out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    num_groups = K // QK8_0
    cfg = config or gemv_config(N, num_groups, x.device)
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
        **launch_options(cfg, x.dtype),
        **pdl,
    )
    return out


def _q8_0_matmul_op(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    _check(x, qs, d)
    if x.stride(1) != 1 or qs.stride(1) != 1 or d.stride(1) != 1:
        raise ValueError("q8_0_matmul needs x, qs and d with the last dimension contiguous")
    T, K = x.shape
    N = qs.shape[0]
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    if T <= GEMV_MAX_T:
        return q8_0_gemv(x, qs, d, out=out)
    cfg = matmul_config(T, N, K, x.device, x.dtype)
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    per_split = triton.cdiv(triton.cdiv(K, bk), split) * bk
    n_tiles = triton.cdiv(T, bm) * triton.cdiv(N, bn)
    part, locks = split_k_buffers(x.device, n_tiles, split, bm, bn)
    _q8_0_matmul_kernel[(n_tiles, split)](
        x,
        qs,
        d,
        out,
        part,
        locks,
        T,
        N,
        K,
        per_split,
        x.stride(0),
        qs.stride(0),
        d.stride(0),
        out.stride(0),
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


def dequantize_q8_0_ref(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] weights."""
    g = qs.float().reshape(*qs.shape[:-1], -1, QK8_0) * d.float()[..., None]
    return g.reshape(qs.shape)


def q8_0_matmul_ref(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    _check(x, qs, d)
    return (x.float() @ dequantize_q8_0_ref(qs, d).T).to(x.dtype)


q8_0_matmul = dispatch("q8_0_matmul", _q8_0_matmul_op, q8_0_matmul_ref)


def q8_0_embedding(ids: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [T] of a q8_0 table, dequantized: fp32 [T, K]."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be an integer [T] tensor, got {ids.dtype} {tuple(ids.shape)}")
    return dequantize_q8_0_ref(qs[ids], d[ids])


def bench_specs(device: str = "cuda") -> list[dict]:
    """Qwen3 0.6B and 8B projections (qkv, o, gate_up, down) from decode to prefill. Weights are
    rotated through enough copies that every call streams them from HBM, not L2."""
    from kipp_cuda.kernels.bench import TOKENS, linear_shapes, rotating

    specs = []
    for model, shapes in linear_shapes().items():
        for proj, (N, K) in shapes.items():
            wbytes = N * K * (1 + 2 / QK8_0)
            w = [
                (
                    torch.randint(-127, 128, (N, K), dtype=torch.int8, device=device),
                    (torch.rand(N, K // QK8_0, device=device) / 64).to(torch.float16),
                )
                for _ in range(rotating(wbytes))
            ]
            for T in TOKENS:
                x = torch.randn(T, K, device=device, dtype=torch.bfloat16)
                specs.append(
                    {
                        "name": "q8_0_matmul",
                        "shape": f"{model} {proj} T={T} N={N} K={K}",
                        "fn": rotate(q8_0_matmul, x, w),
                        "ref": rotate(q8_0_matmul_ref, x, w),
                        "bytes": wbytes + 2 * T * (K + N),
                        "flops": 2 * T * N * K,
                    }
                )
    return specs


def rotate(fn, x, weights):
    """A no-argument call of fn(x, *weights[i]) with i advancing on every call."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(weights)
        return fn(x, *weights[state["i"]])

    return call
