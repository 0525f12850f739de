"""One-token dense matmul (decode): out[N] = W[N, K] @ x[K], streaming each weight once.

cuBLAS picks GEMM tilings for M = 1 that read a 0.6B layer's weights at about a quarter of the
H200's bandwidth (benchmarks/LOG.md, entry 0f41c84). Here a program owns BLOCK_N full rows, walks
K in BLOCK_K steps with the next step's loads issued before this step's math, and sums in fp32;
small row counts split K (deterministic, see matmul_tiles.store_tile) so that every SM streams.

With `act=True`, x is a gate_up output [1, 2K] and the kernel multiplies by silu(gate) * up,
rounded to x's dtype as silu_and_mul rounds it: the decode step's down_proj needs no separate
SwiGLU launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch
from kipp_cuda.kernels.head_argmax import check_head, head_out, head_ref
from kipp_cuda.kernels.matmul_tiles import _TL, gemv_launch, interpreting, num_sms, store_row
from kipp_cuda.kernels.pdl import launch_kwargs, pdl_trigger, pdl_wait
from kipp_cuda.kernels.tuned import tuned_config


@triton.jit
def _gemv_x(x_ptr, rk, k_mask, K, ACT: tl.constexpr):
    if ACT:  # silu(gate) * up in fp32, rounded like silu_and_mul's output
        g = tl.load(x_ptr + rk, mask=k_mask, other=0.0)
        u = tl.load(x_ptr + K + rk, mask=k_mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        return (gf / (1.0 + tl.exp(-gf)) * u).to(g.dtype).to(tl.float32)
    return tl.load(x_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)


@triton.jit
def _dense_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    lock_ptr,
    key_ptr,
    N,
    K,
    k_per_split,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ACT: tl.constexpr,
    PDL: tl.constexpr,
    HEAD: tl.constexpr,
    ROUND: tl.constexpr,
):
    # w: [N, K] row-major. Program (row block, K split): rows rn, K range [k_start, k_end).
    pdl_trigger(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    rk = k_start + tl.arange(0, BLOCK_K)
    w = tl.load(rows + rk[None, :], mask=n_mask[:, None] & (rk < k_end)[None, :], other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    pdl_wait(PDL)  # the first weight tile is in flight; x comes from the previous kernel
    for k0 in range(k_start, k_end, BLOCK_K):
        # Issue the next step's weight loads before this step's math: two steps in flight.
        nk = k0 + BLOCK_K + tl.arange(0, BLOCK_K)
        nw = tl.load(rows + nk[None, :], mask=n_mask[:, None] & (nk < k_end)[None, :], other=0.0)
        rk = k0 + tl.arange(0, BLOCK_K)
        x = _gemv_x(x_ptr, rk, rk < k_end, K, ACT)
        acc += w.to(tl.float32) * x[None, :]
        w = nw
    store_row(
        acc, out_ptr, part_ptr, lock_ptr, rn, N, pid_n, pid_k, BLOCK_N, SPLIT_K, False,
        HEAD, key_ptr, ROUND,
    )  # fmt: skip


def gemv_config(N: int, K: int, device: torch.device) -> dict:
    """From the H200 sweeps in CUDA graphs (tools/sweep/kernel_sweep.py; benchmarks/LOG.md,
    entries f9eb3ee and 230e152): about 512+ programs of BLOCK_N rows, 256 or 512 columns a step
    (512 beats 1024 at K > 4096 on the 32B shard shapes: 942 against 969 us summed over the 20
    swept shapes); split K only when rows leave SMs idle. Shapes in the tuned table skip this."""
    if interpreting():
        return dict(BLOCK_N=8, BLOCK_K=64, SPLIT_K=1, num_warps=4)
    tuned = tuned_config("dense", N, K)
    if tuned is not None:
        return tuned
    block_n = max(2, min(16, triton.next_power_of_2(N // 512 + 1) // 2))
    block_k = min(triton.next_power_of_2(K), 256 if K <= 1024 else 512)
    split = 1
    while (
        triton.cdiv(N, block_n) * split * 2 <= num_sms(device)
        and K // (split * 2) >= block_k
        and split < 16
    ):
        split *= 2
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4)


def _dense_gemv_op(
    x: torch.Tensor,
    w: torch.Tensor,
    act: bool = False,
    config: dict | None = None,
    head_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [1, K] (or [1, 2K] gate_up with act=True), w [N, K] -> [1, N] in x.dtype. head_keys
    (head_argmax.py; not with act): fp32 [1, N], the bits of the plain call's .float(), and
    head_keys[0] takes the running argmax key (finish_argmax reads it)."""
    check_head(head_keys, x.shape[0] if x.dim() == 2 else -1, act)
    K = w.shape[1] if w.dim() == 2 else -1
    if x.dim() != 2 or x.shape[0] != 1 or w.dim() != 2 or x.shape[1] != (2 * K if act else K):
        raise ValueError(
            f"dense_gemv needs x [1, {'2K' if act else 'K'}] and w [N, K], got "
            f"{tuple(x.shape)}, {tuple(w.shape)}"
        )
    if w.stride(1) != 1:
        raise ValueError("dense_gemv needs w with a contiguous K dimension")
    N = w.shape[0]
    x = x.contiguous()
    head = head_keys is not None
    out = head_out(None, N, x) if head else torch.empty((1, N), dtype=x.dtype, device=x.device)
    if N == 0:
        return out
    cfg = config or gemv_config(N, K, x.device)
    grid, per_split, part, locks = gemv_launch(x.device, N, K, cfg, "BLOCK_K")
    pdl = launch_kwargs(x.device)
    _dense_gemv_kernel[grid](
        x,
        w,
        out,
        part,
        locks,
        head_keys,
        N,
        K,
        per_split,
        w.stride(0),
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        SPLIT_K=cfg["SPLIT_K"],
        ACT=act,
        PDL=bool(pdl),
        HEAD=head,
        ROUND=_TL[x.dtype] if head else None,
        num_warps=cfg["num_warps"],
        num_stages=1,
        **pdl,
    )
    return out


def dense_gemv_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    act: bool = False,
    config: dict | None = None,
    head_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    check_head(head_keys, x.shape[0] if x.dim() == 2 else -1, act)
    if act:
        from kipp_cuda.kernels.swiglu import silu_and_mul_ref

        x = silu_and_mul_ref(x)
    return head_ref(torch.nn.functional.linear(x, w), head_keys)


dense_gemv = dispatch("dense_gemv", _dense_gemv_op, dense_gemv_ref)


def bench_specs(device: str = "cuda") -> list[dict]:
    specs = []
    for name, (N, K) in {
        "0.6B gate_up": (6144, 1024),
        "8B gate_up": (24576, 4096),
        "8B down": (4096, 12288),
    }.items():
        x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16)
        specs.append(
            {
                "name": f"dense_gemv {name}",
                "fn": lambda x=x, w=w: _dense_gemv_op(x, w),
                "ref": lambda x=x, w=w: dense_gemv_ref(x, w),
                "bytes": N * K * 2,
                "flops": 2 * N * K,
            }
        )
    return specs
