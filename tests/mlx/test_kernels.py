"""Custom kernels and their references: the references against numpy, the kernels against the
references where a GPU runs them, and the compile-and-probe ladder (clean fallback where Metal is
absent, a loud failure when kernels are required, the switch that turns them off)."""

from __future__ import annotations

import logging
from functools import partial

import mlx.core as mx
import numpy as np
import pytest

from kipp_core import fastpath
from kipp_core.quant import dequantize_q8_0 as np_dequantize_q8_0
from kipp_core.quant import quantize_q8_0 as np_quantize_q8_0
from kipp_mlx import quant
from kipp_mlx.kernels import ladder
from kipp_mlx.kernels import paged_attention as pa
from kipp_mlx.kernels import q8_0_matmul as qm
from tests.mlx.conftest import make_backend


@pytest.fixture(autouse=True)
def fresh_fallbacks(monkeypatch):
    monkeypatch.delenv("KIPP_MLX_REQUIRE_KERNELS", raising=False)
    monkeypatch.delenv("KIPP_MLX_DISABLE_KERNELS", raising=False)
    fastpath.clear_fallbacks()
    yield
    fastpath.clear_fallbacks()


def _np_paged_attention(q, k_pool, v_pool, tables, lens, scale, bs):
    """Plain numpy: gather each sequence's context through its block table, softmax, weigh V."""
    B, HQ, D = q.shape
    HKV = k_pool.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for b in range(B):
        slots = [tables[b][t // bs] * bs + t % bs for t in range(lens[b])]
        k = np.repeat(k_pool[slots].astype(np.float64), HQ // HKV, axis=1)  # [ctx, HQ, D]
        v = np.repeat(v_pool[slots].astype(np.float64), HQ // HKV, axis=1)
        s = np.einsum("hd,thd->ht", q[b], k) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), v)
    return out


@pytest.mark.parametrize("shape", [(8, 2, 32, 4), (6, 3, 64, 16), (4, 4, 16, 5)])
def test_paged_attention_ref_matches_numpy(shape):
    args = pa.probe_inputs(*shape, mx.float32, seed=sum(shape))
    got = np.array(pa.paged_attention_ref(*args))
    host = [np.array(a) if isinstance(a, mx.array) else a for a in args]
    np.testing.assert_allclose(got, _np_paged_attention(*host), atol=2e-6, rtol=1e-5)


def test_q8_0_quantize_matches_numpy_reference():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((37, 96)).astype(np.float32) * 3
    w[0, :32] = 0.0  # an all-zero block
    w[1, :32] = np.arange(32) - 15.5  # amax 127 below: d = 1, so x / d hits exact halves
    w[1, 0] = 127.0
    w[2, :32] = 127 * 0.25 * np.sign(rng.standard_normal(32))
    qs, d = quant.quantize_q8_0(mx.array(w))
    rqs, rd = np_quantize_q8_0(w)
    np.testing.assert_array_equal(np.array(qs), rqs)
    np.testing.assert_array_equal(np.array(d), rd)
    back = quant.dequantize_q8_0(qs, d)
    np.testing.assert_array_equal(np.array(back), np_dequantize_q8_0(rqs, rd))


def test_q8_0_to_affine8_is_exact():
    rng = np.random.default_rng(1)
    qs, d = quant.quantize_q8_0(mx.array(rng.standard_normal((24, 128)).astype(np.float32)))
    w, s, b = quant.q8_0_to_affine8(qs, d)
    affine = mx.dequantize(w, s, b, group_size=32, bits=8)
    assert mx.array_equal(affine, quant.dequantize_q8_0(qs, d)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_q8_0_matmul_ref_matches_numpy(dtype):
    x, qs, d = qm.probe_inputs(dtype, seed=3)
    got = np.array(qm.q8_0_matmul_ref(x, qs, d).astype(mx.float32))
    w = np_dequantize_q8_0(np.array(qs), np.array(d))
    want = np.array(x.astype(mx.float32)) @ w.T
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# -- the ladder ---------------------------------------------------------------------------------


def _probe():
    return (mx.array(np.arange(6, dtype=np.float32)),)


def test_ladder_keeps_an_agreeing_kernel():
    def fast(x):
        return x * 2 + 1e-7

    def ref(x):
        return x * 2

    assert ladder.choose("t_ok", fast, ref, _probe, 1e-5, 1e-5) is fast
    assert not fastpath.fallbacks()


@pytest.mark.parametrize(
    "fast,reason",
    [
        (lambda x: x * 3, "disagrees"),
        (
            lambda x: mx.fast.metal_kernel("bad", ["x"], ["out"], "out[0] = x[0];")(
                inputs=[x],
                grid=(1, 1, 1),
                threadgroup=(1, 1, 1),
                output_shapes=[x.shape],
                output_dtypes=[x.dtype],
            )[0],
            "compile or launch failed",
        ),
        (None, "no kernel"),
    ],
)
def test_ladder_falls_back_once_and_says_why(caplog, fast, reason):
    def ref(x):
        return x * 2

    with caplog.at_level(logging.WARNING, logger="kipp"):
        for _ in range(3):
            assert ladder.choose("t_bad", fast, ref, _probe, 1e-5, 1e-5) is ref
    assert reason in fastpath.fallbacks()[("mlx", "t_bad")]
    assert len([r for r in caplog.records if "t_bad" in r.getMessage()]) == 1


@pytest.mark.skipif(ladder.gpu_kind() is not None, reason="checks the CPU-only fallback")
def test_real_kernels_fall_back_cleanly_without_metal(caplog):
    """The Metal kernel itself, launched where Metal is absent, falls back to the reference."""
    with caplog.at_level(logging.WARNING, logger="kipp"):
        fn = ladder.choose(
            "paged_attention_metal",
            partial(pa.paged_attention, kind="metal"),
            pa.paged_attention_ref,
            lambda: pa.probe_inputs(4, 2, 32, 8, mx.float32),
            1e-4,
            1e-4,
        )
    assert fn is pa.paged_attention_ref
    assert "compile or launch failed" in fastpath.fallbacks()[("mlx", "paged_attention_metal")]
    assert ladder.paged_attention_fn(4, 2, 32, 8, mx.float32) is pa.paged_attention_ref
    assert ladder.q8_0_matmul_fn(mx.float32) == (qm.q8_0_matmul_ref, False)
    assert "no Metal or CUDA" in fastpath.fallbacks()[("mlx", "q8_0_matmul")]


@pytest.mark.skipif(ladder.gpu_kind() is not None, reason="checks the CPU-only fallback")
def test_required_kernels_make_load_fail(monkeypatch, tiny_path):
    monkeypatch.setenv("KIPP_MLX_REQUIRE_KERNELS", "1")
    with pytest.raises(fastpath.KernelUnavailableError, match="paged_attention"):
        make_backend(tiny_path)
    with pytest.raises(fastpath.KernelUnavailableError, match="q8_0_matmul"):
        ladder.q8_0_matmul_fn(mx.float32)


def test_disabled_kernels_use_references_without_a_fallback(monkeypatch):
    monkeypatch.setenv("KIPP_MLX_DISABLE_KERNELS", "1")
    monkeypatch.setenv("KIPP_MLX_REQUIRE_KERNELS", "1")  # a switched-off kernel is not a fallback
    assert ladder.paged_attention_fn(4, 2, 32, 8, mx.float32) is pa.paged_attention_ref
    assert ladder.q8_0_matmul_fn(mx.float32) == (qm.q8_0_matmul_ref, False)
    assert not fastpath.fallbacks()


# -- on a GPU: the kernels themselves -----------------------------------------------------------

gpu = pytest.mark.skipif(
    ladder.gpu_kind() is None,
    reason="custom kernels need MLX on Metal or CUDA; this MLX runs on the CPU",
)


@gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", [(8, 2, 128, 32), (16, 8, 64, 16), (5, 5, 32, 3)])
def test_paged_attention_kernel_matches_ref(dtype, shape):
    args = pa.probe_inputs(*shape, dtype, seed=7)
    got = pa.paged_attention(*args, kind=ladder.gpu_kind())
    want = pa.paged_attention_ref(*args)
    atol, rtol = ladder.tolerance(dtype)
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol, rtol=rtol
    )


@gpu
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("rows,n,k", [(1, 1823, 96), (3, 37, 1024), (8, 781, 32)])
def test_q8_0_matmul_kernel_matches_ref(dtype, rows, n, k):
    rng = np.random.default_rng(rows + n)
    qs, d = quant.quantize_q8_0(mx.array(rng.standard_normal((n, k)).astype(np.float32)))
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
    got = qm.q8_0_matmul(x, qs, d, kind=ladder.gpu_kind())
    want = qm.q8_0_matmul_ref(x, qs, d)
    atol, rtol = ladder.tolerance(dtype)
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=atol, rtol=rtol
    )
