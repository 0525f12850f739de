"""The compile-and-probe ladder: at load every custom kernel is compiled and run on a probe input
at the model's own shapes and dtype, and compared with its ops reference. A kernel that is
switched off runs its reference silently; one that is unavailable, fails or disagrees falls back
to its reference through kipp_core.fastpath.report_fallback (logged once; fatal under
KIPP_MLX_REQUIRE_KERNELS=1). `attach` puts the chosen functions on a loaded model."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kipp_core.fastpath import kernel_disabled, report_fallback

log = logging.getLogger("kipp")

BACKEND = "mlx"
NO_GPU = "no Metal or CUDA device (MLX runs on the CPU)"
# MLX's CUDA build: from 16 rows of x an affine linear dequantizes its weight and runs the dense
# GEMM (at 64 rows of the 8B gate_up: ~70 us to dequantize + ~120 us of GEMM, against ~270 us in
# MLX's quantized GEMM, on an H200; Metal keeps MLX's quantized GEMM)
DEQUANT_ROWS = 16


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


def _as_f32(x) -> list[np.ndarray]:
    xs = x if isinstance(x, (tuple, list)) else (x,)
    return [np.array(a.astype(mx.float32)) for a in xs]


def choose(
    name: str,
    fast: Callable | None,
    ref: Callable,
    probe: Callable[[], tuple],
    atol: float,
    rtol: float,
    why_none: str = "",
) -> Callable:
    """`fast` when it compiles, runs and agrees with `ref` on `probe()`'s inputs, else `ref`.
    Either may return one array or a tuple of arrays; `probe` makes the same inputs each call."""
    if kernel_disabled(BACKEND, name):
        log.info(
            "mlx kernel %s is switched off (KIPP_MLX_DISABLE_KERNELS); using its reference", name
        )
        return ref
    if fast is None:
        report_fallback(BACKEND, name, why_none or "no kernel for this device")
        return ref
    try:
        # a probe a call: a kernel that writes one of its inputs in place must not feed the other
        got, want = fast(*probe()), ref(*probe())
        mx.eval(got, want)
        got, want = _as_f32(got), _as_f32(want)
    except Exception as e:  # a compile or launch error: any exception means "not usable here"
        report_fallback(BACKEND, name, f"compile or launch failed: {type(e).__name__}: {e}")
        return ref
    for g, w in zip(got, want):
        if g.shape != w.shape or not np.allclose(g, w, atol=atol, rtol=rtol):
            err = float(np.abs(g - w).max()) if g.shape == w.shape else float("nan")
            report_fallback(
                BACKEND, name, f"probe disagrees with the reference (max error {err:.3g})"
            )
            return ref
    log.info("mlx kernel %s passed its probe", name)
    return fast


def tolerance(dtype) -> tuple[float, float]:
    """float32: the kernels and references differ only in summation order (K <= 12,288 terms of
    unit size: ~1e-5); 16-bit: a one-ulp rounding difference of the output (2^-8 relative in
    bf16) on values of order 1-10."""
    return (1e-4, 1e-4) if dtype == mx.float32 else (3e-2, 3e-2)


def _pick(name: str, module, dtype, probe: Callable[[], tuple], why: str | None = None):
    """The kernel `module.<name>` on this device, or its reference."""
    kind = gpu_kind()
    fast = getattr(module, name)
    ref = getattr(module, name + "_ref")
    if kind is None or why:
        return choose(name, None, ref, probe, *tolerance(dtype), why_none=why or NO_GPU)
    return choose(name, partial(fast, kind=kind), ref, probe, *tolerance(dtype))


def decode_attention_fn(cfg, block_size: int, dtype) -> Callable | None:
    """The paged decode kernel, or None (the batched gather reference)."""
    from kipp_mlx.kernels import decode_attention as da

    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    vec = 16 // dtype.size
    why = None
    if d % vec or 128 % (d // vec) or hq // hkv > 8:
        why = f"head_dim {d} or {hq // hkv} query heads a kv head do not fit its layout"
    fn = _pick(
        "decode_attention",
        da,
        dtype,
        lambda: da.probe_inputs(hq, hkv, d, block_size, dtype),
        why,
    )
    return None if fn is da.decode_attention_ref else fn


def _inplace_write(qr, hq: int, hkv: int, d: int, dtype, why: str | None) -> Callable | None:
    """The in-place K/V write (qk_norm_rope_write), or None: qk_norm_rope, then the cache's
    scatter (its reference is that scatter, so the model takes the two-launch path for it)."""
    probe = lambda: qr.write_probe_inputs(hq, hkv, d, dtype)  # noqa: E731
    fn = _pick("qk_norm_rope_write", qr, dtype, probe, why)
    return None if fn is qr.qk_norm_rope_write_ref else fn


def model_kernels(cfg, block_size: int, dtype):
    """The Kernels of one model (kipp_mlx.model.Kernels)."""
    from kipp_mlx.kernels import add_rms_norm as an
    from kipp_mlx.kernels import qk_norm_rope as qr
    from kipp_mlx.kernels import swiglu as sw
    from kipp_mlx.model import Kernels

    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    why = None if d % 32 == 0 else f"head_dim {d} is not a multiple of 32"
    return Kernels(
        qk_norm_rope=_pick(
            "qk_norm_rope", qr, dtype, lambda: qr.probe_inputs(hq, hkv, d, dtype), why
        ),
        qk_norm_rope_write=_inplace_write(qr, hq, hkv, d, dtype, why),
        add_rms_norm=_pick(
            "add_rms_norm", an, dtype, lambda: an.probe_inputs(cfg.hidden_size, dtype)
        ),
        decode_attention=decode_attention_fn(cfg, block_size, dtype),
        swiglu=_pick("swiglu", sw, dtype, lambda: sw.probe_inputs(dtype)),
    )


def attach(model: nn.Module, cfg, dtype, block_size: int) -> None:
    """Choose the model's kernels and put them on it: the step's kernels, and the decode GEMV on
    every affine-quantized linear (and a quantized tied head), which on MLX's CUDA build also
    dequantizes for wide inputs (DEQUANT_ROWS). Dense linears keep MLX's own matmul, which was
    faster at M = 1 on an H200 than a plain CUDA GEMV."""
    from kipp_mlx.kernels import affine_gemv as ag
    from kipp_mlx.quant import AffineLinear

    model.set_kernels(model_kernels(cfg, block_size, dtype))
    affine = [m for _, m in model.named_modules() if isinstance(m, AffineLinear)]
    for bits in sorted({m.bits for m in affine}):
        fn = _pick(
            "affine_gemv",
            ag,
            dtype,
            lambda bits=bits: ag.probe_inputs(dtype, bits),
            None if {m.group_size for m in affine} == {ag.GROUP_SIZE} else "group size not 32",
        )
        fast = None if fn is ag.affine_gemv_ref else fn
        for m in affine:
            if m.bits == bits:
                m.gemv, m.gemv_rows = fast, (ag.MAX_ROWS_X if fast is not None else 0)
                m.dequant_rows = DEQUANT_ROWS if gpu_kind() == "cuda" else None
