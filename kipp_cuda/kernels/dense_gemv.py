"""One-token dense matmul (decode): out[N] = W[N, K] @ x[K], streaming each weight once.

cuBLAS picks GEMM tilings for M = 1 that read a 0.6B layer's weights at about a quarter of the
H200's bandwidth (profile in BENCHMARKS.md); this kernel gives each program a few full rows and
sums along K in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch


@triton.jit
def _dense_gemv_kernel(
    x_ptr, w_ptr, out_ptr,
    N, K, stride_wn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # w: [N, K] row-major; a program owns BLOCK_N rows and walks K in BLOCK_K chunks.
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        w = tl.load(rows + rk[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + rk, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv_config(N: int, K: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): about 512+ programs, 8 KB of weights per program per step."""
    block_n = 1
    while block_n < 16 and N // (block_n * 2) >= 512:
        block_n *= 2
    block_k = max(64, min(triton.next_power_of_2(K), 4096 // block_n))
    return block_n, block_k


def _dense_gemv_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [1, K], w [N, K] -> [1, N] in x.dtype."""
    if x.dim() != 2 or x.shape[0] != 1 or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"dense_gemv needs x [1, K] and w [N, K], got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}")
    if w.stride(1) != 1:
        raise ValueError("dense_gemv needs w with a contiguous K dimension")
    N, K = w.shape
    x = x.contiguous()
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    block_n, block_k = gemv_config(N, K)
    _dense_gemv_kernel[(triton.cdiv(N, block_n),)](
        x, w, out, N, K, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        num_stages=4)
    return out


def dense_gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


dense_gemv = dispatch("dense_gemv", _dense_gemv_op, dense_gemv_ref)


def bench_specs(device: str = "cuda") -> list[dict]:
    specs = []
    for name, (N, K) in {"0.6B gate_up": (6144, 1024), "8B gate_up": (24576, 4096),
                         "8B down": (4096, 12288)}.items():
        x = torch.randn(1, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16)
        specs.append({"name": f"dense_gemv {name}", "fn": lambda x=x, w=w: _dense_gemv_op(x, w),
                      "ref": lambda x=x, w=w: dense_gemv_ref(x, w), "bytes": N * K * 2,
                      "flops": 2 * N * K})
    return specs
