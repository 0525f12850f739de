"""Triton kernels, one op a file. Each file holds `_<op>_kernel` (the kernel), `<op>` (checks,
allocates, launches) and `<op>_ref` (the same function in plain torch).

`dispatch(name, op, ref)` picks per call: the Triton op when it can run on the tensors' device
(CUDA; or CPU when both TRITON_INTERPRET=1 and KIPP_CUDA_INTERPRET=1, which the kernel
integration tests set) and the kernel is not switched off by
KIPP_CUDA_DISABLE_KERNELS; else the reference, after one logged fallback (fatal under
KIPP_CUDA_REQUIRE_KERNELS=1). A kernel switched off by the user is not a fallback.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable

from kipp_core.fastpath import kernel_disabled, report_fallback

BACKEND = "cuda"


@functools.lru_cache(maxsize=1)
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(device_type: str) -> str | None:
    """None if Triton kernels can run on this device type, else the reason they cannot."""
    if not _has_triton():
        return "triton is not installed"
    if device_type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("KIPP_CUDA_INTERPRET") == "1":
        return None
    return f"tensors are on {device_type} (Triton kernels need a CUDA device)"


def dispatch(name: str, op: Callable, ref: Callable) -> Callable:
    """`op` where it can run, else `ref`; the choice is made on the first tensor argument."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        if kernel_disabled(BACKEND, name):
            return ref(*args, **kwargs)
        dev = next(a.device.type for a in args if hasattr(a, "device"))
        reason = triton_runs_on(dev)
        if reason is not None:
            report_fallback(BACKEND, name, reason)
            return ref(*args, **kwargs)
        return op(*args, **kwargs)

    run.op, run.ref = op, ref
    return run
