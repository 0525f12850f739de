"""Programmatic dependent launch (PDL, sm_90+): a decode kernel starts while the one before it
finishes. Each kernel launched with it calls `pdl_trigger` first (its successor may launch), may
load what no earlier kernel writes (weights), then calls `pdl_wait` (the predecessor has finished
and its writes are visible) before it reads activations or writes anything. So the weight loads
of a GEMV and every kernel's launch latency overlap the previous kernel's tail; the arithmetic is
unchanged, which the GPU tests check by comparing decode with and without it bit for bit.

`launch_kwargs(device)` is what a launch passes: {"launch_pdl": True} with PDL on, else {}. Off
under the interpreter and on GPUs before sm_90 (there is no PDL there), and when the user sets
KIPP_CUDA_PDL=0. A Hopper GPU whose Triton cannot launch with PDL is a reported fallback (fatal
under KIPP_CUDA_REQUIRE_KERNELS=1).

`prefetch_l2` goes further for the one-token GEMVs: before its wait, a program asks for its whole
weight slice to be moved into L2 (one bulk prefetch a range, sm_90), so HBM streams the weights
while the kernels before it, which barely use HBM (norms, RoPE, SwiGLU, short attention), finish.
It is a hint: the loads after the wait read the same bytes, from L2 when they arrived in time.
KIPP_CUDA_L2_PREFETCH=0 turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kipp_core.fastpath import report_fallback

try:  # Triton >= 3.3; the `if PDL:` branches that call them compile only with PDL on
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


@functools.lru_cache(maxsize=8)
def _device_has_pdl(device: torch.device) -> bool:
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        supported = gdc_wait is not None and "launch_pdl" in CUDAOptions.__dataclass_fields__
    except ImportError:
        supported = False
    if not supported:
        report_fallback("cuda", "pdl", f"triton {triton.__version__} cannot launch with PDL")
    return supported


# One thread (thread 0 of the program) prefetches [$1, $1 + $2) rounded inward to 16 bytes, as
# cp.async.bulk needs; an empty range issues nothing. $0 is the dummy output inline asm requires.
_PREFETCH_ASM = tl.constexpr("""{
.reg .pred p, q;
.reg .u32 t;
.reg .b64 a, e;
mov.u32 t, %tid.x;
setp.eq.u32 p, t, 0;
add.s64 e, $1, $2;
add.s64 a, $1, 15;
and.b64 a, a, 0xFFFFFFFFFFFFFFF0;
and.b64 e, e, 0xFFFFFFFFFFFFFFF0;
setp.gt.s64 q, e, a;
and.pred p, p, q;
sub.s64 e, e, a;
cvt.u32.u64 t, e;
@p cp.async.bulk.prefetch.L2.global [a], t;
mov.u32 $0, 0;
}""")


@triton.jit
def prefetch_l2(ptr, count, ON: tl.constexpr):
    """A hint: move `count` elements from `ptr` on into L2 (a scalar pointer and count)."""
    if ON:
        nbytes = count.to(tl.int64) * (ptr.dtype.element_ty.primitive_bitwidth // 8)
        tl.inline_asm_elementwise(
            asm=_PREFETCH_ASM,
            constraints="=r,l,l",
            args=[ptr, nbytes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def prefetch_rows(
    base, r0, num_rows, stride, first, count, SPLIT_K: tl.constexpr, ON: tl.constexpr
):
    """prefetch_l2 of elements [first, first + count) of rows r0 .. r0 + num_rows - 1 of a
    row-major [rows, stride] tensor: one range over the rows when each row is taken whole
    (SPLIT_K == 1), else one a row, so other splits' bytes are not fetched twice."""
    if ON:
        if SPLIT_K == 1:
            start = base + r0.to(tl.int64) * stride + first
            prefetch_l2(start, (num_rows - 1) * stride + count, ON)
        else:
            for r in range(0, num_rows):
                prefetch_l2(base + (r0 + r).to(tl.int64) * stride + first, count, ON)


def l2_prefetch_enabled() -> bool:
    """Whether the one-token GEMVs prefetch their weights into L2 (KIPP_CUDA_L2_PREFETCH=0: no)."""
    return os.environ.get("KIPP_CUDA_L2_PREFETCH", "1").strip() not in ("0", "false", "no")


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL (read per call: KIPP_CUDA_PDL=0 turns it off)."""
    if os.environ.get("KIPP_CUDA_PDL", "1").strip() in ("0", "false", "no"):
        return False
    return _device_has_pdl(device)


def launch_kwargs(device: torch.device) -> dict:
    return {"launch_pdl": True} if pdl_enabled(device) else {}
