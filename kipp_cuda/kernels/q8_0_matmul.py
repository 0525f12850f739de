"""Weight-only Q8_0 matmul: out [T, N] = x [T, K] @ dequant(qs, d)^T, dequantizing in the kernel.

qs: int8 [N, K]; d: fp16 [N, K / 32]; w[n, k] = qs[n, k] * d[n, k // 32] (ggml q8_0). Accumulation
is fp32; the output has x's dtype. Two kernels, chosen by T:
- T == 1 (decode of one sequence): q8_0_gemv.py, a weight-streaming GEMV on CUDA cores.
- T > 1: `_q8_0_matmul_kernel`, tl.dot on tiles dequantized to the activation dtype (bf16 rounding
  of w, like bf16 weights). For T <= 16 a 16-row tile with split-K keeps the weights streaming
  (tensor cores make 2..16 tokens cost what one does); for prefill, 64/128/256-row tiles with
  grouped ordering for L2 reuse.
Split-K partials are summed in a fixed order by the last program of each tile (a per-tile counter
taken with an acq_rel atomic), so results are deterministic and need no second launch.
The tl.dot kernel converts without the quarter-rate I2F, through the float bits of 2**23
(int8_to_float).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_core.quant import QK8_0
from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.head_argmax import check_head, head_ref
from kipp_cuda.kernels.matmul_tiles import (
    _TL,
    dot_dtype,
    interpreting,
    pick_split_k,
    split_k_buffers,
    store_tile,
    tile_ids,
)
from kipp_cuda.kernels.q8_0_gemv import q8_0_gemv
from kipp_cuda.kernels.swiglu import silu_and_mul, silu_and_mul_ref

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


def _check(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, swiglu: bool = False) -> None:
    if swiglu and qs.dim() == 2 and qs.shape[0] % 2:
        raise ValueError(f"swiglu needs gate and up rows (an even N), got qs {tuple(qs.shape)}")
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


def _q8_0_matmul_op(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    swiglu: bool = False,
    head_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] @ dequant(qs, d)^T -> [T, N]. swiglu: qs holds gate then up rows (a gate_up_proj)
    and the result is their SwiGLU [T, N / 2]; the one-token GEMV computes it in its epilogue.
    head_keys (T = 1 only; head_argmax.py): fp32 logits [1, N] and the running argmax key."""
    _check(x, qs, d, swiglu)
    check_head(head_keys, x.shape[0], swiglu)
    if x.stride(1) != 1 or qs.stride(1) != 1 or d.stride(1) != 1:
        raise ValueError("q8_0_matmul needs x, qs and d with the last dimension contiguous")
    T, K = x.shape
    N = qs.shape[0]
    if 0 < T <= GEMV_MAX_T and N and K:
        return q8_0_gemv(x, qs, d, swiglu=swiglu, head_keys=head_keys)
    out = _q8_0_product(x, qs, d)
    out = head_ref(out, head_keys)  # (N or K = 0)
    return silu_and_mul(out) if swiglu else out


def _q8_0_product(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    T, K = x.shape
    N = qs.shape[0]
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
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


def q8_0_matmul_ref(
    x: torch.Tensor,
    qs: torch.Tensor,
    d: torch.Tensor,
    swiglu: bool = False,
    head_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    _check(x, qs, d, swiglu)
    check_head(head_keys, x.shape[0], swiglu)
    out = (x.float() @ dequantize_q8_0_ref(qs, d).T).to(x.dtype)
    out = head_ref(out, head_keys)
    return silu_and_mul_ref(out) if swiglu else out


q8_0_matmul = dispatch("q8_0_matmul", _q8_0_matmul_op, q8_0_matmul_ref)


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
