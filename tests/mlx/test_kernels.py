"""Custom kernels' references against numpy and the oracle, and the compile-and-probe ladder
(clean fallback where no GPU runs them, a loud failure when kernels are required, the switch that
turns them off). The kernels themselves against these references: test_kernels_gpu.py."""

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
from kipp_mlx.kernels import add_rms_norm as an
from kipp_mlx.kernels import affine_gemv as ag
from kipp_mlx.kernels import decode_attention as da
from kipp_mlx.kernels import ladder
from kipp_mlx.kernels import qk_norm_rope as qr
from oracle.qwen3 import apply_rope, rms_norm, rope_cos_sin
from tests.mlx.conftest import make_backend


@pytest.fixture(autouse=True)
def fresh_fallbacks(monkeypatch):
    monkeypatch.delenv("KIPP_MLX_REQUIRE_KERNELS", raising=False)
    monkeypatch.delenv("KIPP_MLX_DISABLE_KERNELS", raising=False)
    fastpath.clear_fallbacks()
    yield
    fastpath.clear_fallbacks()


def host(args):
    return [np.array(a) if isinstance(a, mx.array) else a for a in args]


def _np_decode_attention(q, kv_pool, tables, lens, scale, bs):
    """Plain numpy: gather each sequence's context through its block table, softmax, weigh V."""
    B, HQ, D = q.shape
    HKV = kv_pool.shape[2]
    out = np.zeros_like(q, dtype=np.float64)
    for b in range(B):
        slots = [tables[b][t // bs] * bs + t % bs for t in range(lens[b])]
        k = np.repeat(kv_pool[slots, 0].astype(np.float64), HQ // HKV, axis=1)  # [ctx, HQ, D]
        v = np.repeat(kv_pool[slots, 1].astype(np.float64), HQ // HKV, axis=1)
        s = np.einsum("hd,thd->ht", q[b], k) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        out[b] = np.einsum("ht,thd->hd", p / p.sum(-1, keepdims=True), v)
    return out


@pytest.mark.parametrize("shape", [(8, 2, 32, 4), (6, 3, 64, 16), (4, 4, 16, 5)])
def test_decode_attention_ref_matches_numpy(shape):
    args = da.probe_inputs(*shape, mx.float32, seed=sum(shape))
    got = np.array(da.decode_attention_ref(*args))
    np.testing.assert_allclose(got, _np_decode_attention(*host(args)), atol=2e-6, rtol=1e-5)


def test_split_count_fills_the_gpu():
    assert da.num_splits(1, 8, 2048) == 4  # 512 tokens a split
    assert da.num_splits(1, 8, 128) == 1
    assert da.num_splits(1, 8, 32768) == 33  # 33 x 8 = 264 blocks
    assert da.num_splits(4, 8, 2048) == 4
    assert da.num_splits(2, 8, 32768) == 17
    assert da.num_splits(64, 8, 2048) == 1  # 512 blocks already
    assert da.num_splits(256, 8, 300) == 1


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 2, 32), (6, 2, 64)])
def test_qk_norm_rope_ref_matches_the_oracle(heads, kv_heads, head_dim):
    args = qr.probe_inputs(heads, kv_heads, head_dim, mx.float32, seed=head_dim)
    qkv, qw, kw, pos, _, eps = host(args[:6])
    q, kv = qr.qk_norm_rope_ref(*args)
    x = qkv.reshape(5, heads + 2 * kv_heads, head_dim)
    cos, sin = rope_cos_sin(pos, head_dim, 1_000_000.0)
    want_q = apply_rope(rms_norm(x[:, :heads], qw, eps), cos, sin)
    want_k = apply_rope(rms_norm(x[:, heads : heads + kv_heads], kw, eps), cos, sin)
    np.testing.assert_allclose(np.array(q), want_q, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.array(kv[:, 0]), want_k, atol=2e-6, rtol=1e-5)
    np.testing.assert_array_equal(np.array(kv[:, 1]), x[:, heads + kv_heads :])


def test_rope_table_equals_the_oracle_bit_for_bit():
    pos = np.array([0, 1, 5, 4097, 40959])
    cos, sin = rope_cos_sin(pos, 128, 1_000_000.0)
    table = np.array(qr.rope_table(40960, 128, 1_000_000.0))[pos]
    np.testing.assert_array_equal(table[:, :64], cos[:, :64])
    np.testing.assert_array_equal(table[:, 64:], sin[:, :64])


def test_add_rms_norm_ref_matches_numpy():
    x, r, w, eps = host(an.probe_inputs(96, mx.float32, seed=2))
    h, y = an.add_rms_norm_ref(*an.probe_inputs(96, mx.float32, seed=2))
    np.testing.assert_allclose(np.array(h), x + r, rtol=1e-6)
    np.testing.assert_allclose(np.array(y), rms_norm(x + r, w, eps), atol=2e-6, rtol=1e-5)


def _np_affine_dequant(w, scales, biases, bits):
    per = 32 // bits
    q = np.stack([(w >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], -1)
    q = q.reshape(w.shape[0], -1, 32).astype(np.float64)
    return (q * scales[..., None] + biases[..., None]).reshape(w.shape[0], -1)


@pytest.mark.parametrize("bits", [4, 8])
def test_affine_gemv_ref_matches_numpy(bits):
    args = ag.probe_inputs(mx.float32, bits, rows_x=3, seed=bits)
    x, w, s, b, _ = host(args)
    want = x.astype(np.float64) @ _np_affine_dequant(w, s, b, bits).T
    np.testing.assert_allclose(np.array(ag.affine_gemv_ref(*args)), want, atol=1e-4, rtol=1e-5)


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
def test_real_kernels_fall_back_cleanly_without_a_gpu(caplog):
    """A kernel launched where no GPU runs it falls back to the reference, once, saying why."""
    with caplog.at_level(logging.WARNING, logger="kipp"):
        fn = ladder.choose(
            "decode_attention_metal",
            partial(da.decode_attention, kind="metal"),
            da.decode_attention_ref,
            lambda: da.probe_inputs(4, 2, 32, 8, mx.float32),
            1e-4,
            1e-4,
        )
    assert fn is da.decode_attention_ref
    assert "compile or launch failed" in fastpath.fallbacks()[("mlx", "decode_attention_metal")]
    assert ladder.decode_attention_fn(_cfg(), 8, mx.float32) is None
    assert "no Metal or CUDA" in fastpath.fallbacks()[("mlx", "decode_attention")]


def _cfg():
    from tests.conftest import small_config

    return small_config()


@pytest.mark.skipif(ladder.gpu_kind() is not None, reason="checks the CPU-only fallback")
def test_required_kernels_make_load_fail(monkeypatch, tiny_path):
    monkeypatch.setenv("KIPP_MLX_REQUIRE_KERNELS", "1")
    with pytest.raises(fastpath.KernelUnavailableError, match="qk_norm_rope"):
        make_backend(tiny_path)


def test_disabled_kernels_use_references_without_a_fallback(monkeypatch):
    monkeypatch.setenv("KIPP_MLX_DISABLE_KERNELS", "1")
    monkeypatch.setenv("KIPP_MLX_REQUIRE_KERNELS", "1")  # a switched-off kernel is not a fallback
    k = ladder.model_kernels(_cfg(), 8, mx.float32)
    assert k.decode_attention is None
    assert k.qk_norm_rope is qr.qk_norm_rope_ref and k.add_rms_norm is an.add_rms_norm_ref
    assert not fastpath.fallbacks()


@pytest.mark.skipif(ladder.gpu_kind() is not None, reason="checks the CPU-only fallback")
def test_cpu_model_says_once_which_kernels_fall_back(tiny_path, caplog, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="kipp"):
        make_backend(tiny_path)
        make_backend(tiny_path)
    names = {name for _, name in fastpath.fallbacks()}
    assert {"qk_norm_rope", "qk_norm_rope_write", "add_rms_norm", "decode_attention"} <= names
    for name in ("qk_norm_rope", "qk_norm_rope_write"):
        said = [r for r in caplog.records if f"kernel {name} falls back" in r.getMessage()]
        assert len(said) == 1, name
