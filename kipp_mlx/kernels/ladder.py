"""The compile-and-probe ladder: at load every custom kernel is compiled and run on a probe input
and compared with its ops reference. A kernel that is switched off runs its reference silently;
one that is unavailable, fails or disagrees falls back to its reference through
kipp_core.fastpath.report_fallback (logged once; fatal under KIPP_MLX_REQUIRE_KERNELS=1)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import mlx.core as mx
import numpy as np

from kipp_core.fastpath import kernel_disabled, report_fallback

log = logging.getLogger("kipp")

BACKEND = "mlx"


def gpu_kind() -> str | None:
    """The kernel flavour for MLX's device: "metal", "cuda", or None on the CPU."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)  # MLX builds before the CUDA backend have no mx.cuda
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


def choose(
    name: str,
    fast: Callable | None,
    ref: Callable,
    probe: Callable[[], tuple],
    atol: float,
    rtol: float,
    why_none: str = "",
) -> Callable:
    """`fast` when it compiles, runs and agrees with `ref` on `probe()`'s inputs, else `ref`."""
    if kernel_disabled(BACKEND, name):
        log.info(
            "mlx kernel %s is switched off (KIPP_MLX_DISABLE_KERNELS); using its reference", name
        )
        return ref
    if fast is None:
        report_fallback(BACKEND, name, why_none or "no kernel for this device")
        return ref
    try:
        args = probe()
        got, want = fast(*args), ref(*args)
        mx.eval(got, want)
        got = np.array(got.astype(mx.float32))
        want = np.array(want.astype(mx.float32))
    except Exception as e:  # a compile or launch error: any exception means "not usable here"
        report_fallback(BACKEND, name, f"compile or launch failed: {type(e).__name__}: {e}")
        return ref
    if got.shape != want.shape or not np.allclose(got, want, atol=atol, rtol=rtol):
        err = float(np.abs(got - want).max()) if got.shape == want.shape else float("nan")
        report_fallback(BACKEND, name, f"probe disagrees with the reference (max error {err:.3g})")
        return ref
    log.info("mlx kernel %s passed its probe", name)
    return fast


def tolerance(dtype) -> tuple[float, float]:
    return (1e-4, 1e-4) if dtype == mx.float32 else (3e-2, 3e-2)


def paged_attention_fn(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype
) -> Callable:
    from kipp_mlx.kernels import paged_attention as pa

    kind = gpu_kind()
    fast = partial(pa.paged_attention, kind=kind) if kind else None
    why = "no Metal or CUDA device (MLX runs on the CPU)"
    if kind and head_dim % 32:
        fast, why = None, f"head_dim {head_dim} is not a multiple of 32"
    return choose(
        "paged_attention",
        fast,
        pa.paged_attention_ref,
        lambda: pa.probe_inputs(num_heads, num_kv_heads, head_dim, block_size, dtype),
        *tolerance(dtype),
        why_none=why,
    )


def q8_0_matmul_fn(dtype) -> tuple[Callable, bool]:
    """The q8_0 matmul and whether it is the kernel (False: the caller converts to affine8)."""
    from kipp_mlx.kernels import q8_0_matmul as qm

    kind = gpu_kind()
    fast = partial(qm.q8_0_matmul, kind=kind) if kind else None
    fn = choose(
        "q8_0_matmul",
        fast,
        qm.q8_0_matmul_ref,
        lambda: qm.probe_inputs(dtype),
        *tolerance(dtype),
        why_none="no Metal or CUDA device (MLX runs on the CPU); q8_0 weights are "
        "converted to affine 8-bit at load",
    )
    return fn, fn is not qm.q8_0_matmul_ref
