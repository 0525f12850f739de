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


def pdl_enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL (read per call: KIPP_CUDA_PDL=0 turns it off)."""
    if os.environ.get("KIPP_CUDA_PDL", "1").strip() in ("0", "false", "no"):
        return False
    return _device_has_pdl(device)


def launch_kwargs(device: torch.device) -> dict:
    return {"launch_pdl": True} if pdl_enabled(device) else {}
