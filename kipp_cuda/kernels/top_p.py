"""How many tokens top-p keeps, with the reference's sequential float32 cumsum reproduced exactly.

e: [R, L] float32, per row the values exp(x_sorted - x_max) of the sorted-descending logits (so
e[:, 0] == 1 and each row is non-increasing); top_p: [R] float32. kipp_core.sampling keeps
n_keep = #{j : c[j-1] < top_p * c[-1]} tokens, c = np.cumsum(e, dtype=float32), a sequential sum.
A parallel scan rounds differently and moves the boundary on flat distributions, so the kernel
replays the sequential rounding exactly, a block at a time:

- While the running sum c stays in one binade [2^m, 2^(m+1)), with u = ulp(c), each step is
  c <- c + u * round(e / u): integer arithmetic, so a block is a cumsum of k = round(e / u).
- round() ties (e / u = b + 1/2) go to the even result, which depends on the parity of c / u at
  that point: a two-state associative scan (after a tie the parity is 0; otherwise it flips with
  k's parity) gives it to every element.
- The element that would reach 2^(m+1) is added alone with an ordinary float32 add, and the walk
  resumes after it in the next binade (at most ~18 times a row).
- Once e < u / 2 (e is non-increasing), c can no longer change, so pass 1 (the total) stops
  there; pass 2 stops at the first c[j] >= top_p * total, which gives n_keep = min(j + 1, L).
Rows are independent (one program each); the walk is serial over blocks, typically a few.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import dispatch

BLOCK = 1024


@triton.jit
def _compose(c1, v1, c2, v2):
    # Parity maps p -> v (if const) or p ^ v; this is "apply the first, then the second".
    return c1 | c2, tl.where(c2 != 0, v2, v1 ^ v2)


@triton.jit
def _ulp(c):
    """(u, 1/u) for c >= 1: the spacing of float32 values in c's binade, and its inverse."""
    ef = c.to(tl.int32, bitcast=True) >> 23
    u = ((ef - 23) << 23).to(tl.float32, bitcast=True)
    inv_u = ((277 - ef) << 23).to(tl.float32, bitcast=True)
    return u, inv_u


@triton.jit
def _round_steps(r):
    """k = round(r) for r >= 0 and whether r sits exactly on a tie; fl = floor(r)."""
    fl = tl.floor(r)
    frac = r - fl
    tie = frac == 0.5
    k = tl.where(frac > 0.5, fl + 1.0, fl)
    return k.to(tl.int64), fl.to(tl.int64), tie


@triton.jit
def _walk(row_ptr, L, target, BLOCK: tl.constexpr):
    """Replay c = cumsum(e) from c[0] = e[0]. Returns (c at the end of the walk, the first j with
    c[j] >= target, or L if none). Stops early once c cannot change any more."""
    idx = tl.arange(0, BLOCK)
    c = tl.load(row_ptr).to(tl.float32)
    hit = tl.where(c >= target, 0, L)
    pos = tl.full((), 1, tl.int32)
    go = (hit == L) & (pos < L)
    while go:
        u, inv_u = _ulp(c)
        C = (c * inv_u).to(tl.int64)  # c / u, an integer in [2^23, 2^24)
        offs = pos + idx
        m = offs < L
        e = tl.load(row_ptr + offs, mask=m, other=0.0)
        ep = tl.load(row_ptr + offs - 1, mask=m & (idx > 0), other=0.0)
        k, fl, tie = _round_steps(e * inv_u)
        kp, flp, tiep = _round_steps(ep * inv_u)
        # Parity of c / u before each element: scan the maps of the elements before it.
        gc = (tiep & (idx > 0)).to(tl.int32)
        gv = tl.where(tiep, 0, kp & 1).to(tl.int32)
        sc, sv = tl.associative_scan((gc, gv), 0, _compose)
        par = tl.where(sc != 0, sv, (C & 1).to(tl.int32) ^ sv)
        k = tl.where(tie, fl + ((par + fl) & 1), k)
        R = C + tl.cumsum(k, 0)  # c / u after each element, while in this binade
        over = m & (R >= 16777216)  # would reach 2^(m+1): redo that element as a float add
        f = tl.min(tl.where(over, idx, BLOCK))
        inside = m & (idx < f)
        j = tl.min(tl.where(inside & (R.to(tl.float32) >= target * inv_u), idx, BLOCK))
        if j < BLOCK:
            hit = pos + j
            go = False
        elif f == BLOCK:
            c = tl.sum(tl.where(idx == BLOCK - 1, R, 0)).to(tl.float32) * u
            # Every later e is <= this block's last one; below half an ulp of c (no tie
            # possible) none of them can change c any more.
            _, inv_u = _ulp(c)
            frozen = tl.min(tl.where(m, e, float("inf"))) * inv_u < 0.5
            pos += BLOCK
            go = (pos < L) & (frozen == 0)
        else:
            before = tl.sum(tl.where(idx == f, R - k, 0)).to(tl.float32) * u
            c = before + tl.sum(tl.where(idx == f, e, 0.0))
            if c >= target:
                hit = pos + f
                go = False
            else:
                pos += f + 1
                go = pos < L
    return c, hit


@triton.jit(do_not_specialize=["L", "stride_e"])  # candidate count changes every step
def _top_p_keep_kernel(
    e_ptr,
    top_p_ptr,
    n_keep_ptr,
    total_ptr,
    L,
    stride_e,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = e_ptr + row * stride_e
    total, _ = _walk(row_ptr, L, float("inf"), BLOCK)
    thr = tl.load(top_p_ptr + row) * total
    _, hit = _walk(row_ptr, L, thr, BLOCK)
    tl.store(n_keep_ptr + row, tl.minimum(hit + 1, L).to(tl.int64))
    tl.store(total_ptr + row, total)  # c[-1], for tests


def _check(e: torch.Tensor, top_p: torch.Tensor) -> None:
    if e.dim() != 2 or e.dtype != torch.float32 or top_p.shape != (e.shape[0],):
        raise ValueError(
            f"top_p_keep needs e float32 [R, L] and top_p [R], got {e.dtype} "
            f"{tuple(e.shape)} and {tuple(top_p.shape)}"
        )


def _top_p_keep_op(e: torch.Tensor, top_p: torch.Tensor, return_total: bool = False):
    _check(e, top_p)
    R, L = e.shape
    out = torch.empty(R, dtype=torch.int64, device=e.device)
    total = torch.empty(R, dtype=torch.float32, device=e.device)
    if R and (L == 0 or e.stride(1) != 1):
        raise ValueError("top_p_keep needs at least one column, contiguous")
    if R:
        _top_p_keep_kernel[(R,)](
            e,
            top_p.to(torch.float32).contiguous(),
            out,
            total,
            L,
            e.stride(0),
            BLOCK=BLOCK,
            num_warps=4,
        )
    return (out, total) if return_total else out


def top_p_keep_ref(e: torch.Tensor, top_p: torch.Tensor, return_total: bool = False):
    """The reference's arithmetic itself: numpy's sequential float32 cumsum on the host."""
    _check(e, top_p)
    rows = e.detach().cpu().numpy()
    ps = top_p.detach().cpu().numpy().astype(np.float32)
    out, totals = [], []
    for row, p in zip(rows, ps):
        c = np.cumsum(row, dtype=np.float32)
        before = np.concatenate([np.zeros(1, np.float32), c[:-1]])
        out.append(max(1, int(np.count_nonzero(before < np.float32(p) * c[-1]))))
        totals.append(c[-1])
    n_keep = torch.tensor(out, dtype=torch.int64, device=e.device)
    if return_total:
        return n_keep, torch.tensor(np.array(totals, np.float32), device=e.device)
    return n_keep


top_p_keep = dispatch("top_p_keep", _top_p_keep_op, top_p_keep_ref)


def bench_specs(device: str = "cuda") -> list[dict]:
    """One and 64 rows over Qwen3's vocabulary, top_p 0.9: logits N(0, 2^2) (flat: nearly all of
    the vocabulary counts, the slow case) and N(0, 6^2). The input is each sorted exp row."""
    from kipp_cuda.kernels.bench import VOCAB

    specs = []
    for B in (1, 64):
        for scale in (2.0, 6.0):
            x = torch.randn(B, VOCAB, device=device) * scale
            s = torch.sort(x, dim=-1, descending=True).values
            e = torch.exp(s - s[:, :1]).contiguous()
            p = torch.full((B,), 0.9, device=device)
            specs.append(
                {
                    "name": "top_p_keep",
                    "shape": f"B={B} V={VOCAB} logits*{scale:g}",
                    "fn": lambda a=(e, p): top_p_keep(*a),
                    "ref": lambda a=(e, p): top_p_keep_ref(*a),
                    "bytes": e.numel() * 4,
                    "flops": 0,
                }
            )
    return specs + _sampler_specs(device)


def _sampler_specs(device: str) -> list[dict]:
    """The whole device sampler (kipp_cuda.sampler.sample_rows, host syncs included) against the
    numpy reference on the host, with Qwen3's recommended sampling (temperature 0.6, top_p 0.95,
    top_k 20) and with temperature only."""
    from kipp_core.sampling import SamplerState, SamplingParams, sample_batch
    from kipp_cuda.kernels.bench import VOCAB
    from kipp_cuda.sampler import sample_rows

    specs = []
    for label, params in (
        ("qwen3 defaults", SamplingParams(temperature=0.6, top_p=0.95, top_k=20)),
        ("temperature only", SamplingParams(temperature=0.8)),
    ):
        for B in (1, 64):
            logits = torch.randn(B, VOCAB, device=device) * 4
            states = [SamplerState(params, seed=i, output_token_ids=[1, 2]) for i in range(B)]
            specs.append(
                {
                    "name": "sample_rows",
                    "kernels": ["uniform_rows", "top_p_keep"],
                    "shape": f"B={B} V={VOCAB} {label}",
                    "fn": lambda a=(logits, states): sample_rows(*a),
                    "ref": lambda a=(logits, states): sample_batch(a[0].cpu().numpy(), a[1]),
                    "bytes": logits.numel() * 4,
                    "flops": 0,
                }
            )
    return specs
