"""Quantization references against outside definitions: MLX's own mx.quantize for affine, and
hand-derived ggml q8_0 blocks."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.quant import (
    dequantize_affine,
    dequantize_q8_0,
    pack,
    quantize_affine,
    quantize_q8_0,
    unpack,
)


def test_q8_0_hand_derived_block():
    x = np.zeros(32, dtype=np.float32)
    x[:4] = [1.27, -0.635, 0.005, 0.0]
    x[4] = 0.0025  # 0.0025 / 0.01 = 0.25 -> 0
    x[5] = 0.006  # 0.6 -> 1
    qs, d = quantize_q8_0(x[None])
    # amax 1.27 -> d = 0.01; q = roundf(x / d): 127, -63.5 -> -64 (half away from zero), 0.5 -> 1
    assert d.dtype == np.float16 and float(d[0, 0]) == float(np.float16(0.01))
    assert qs[0, :6].tolist() == [127, -64, 1, 0, 0, 1]
    np.testing.assert_allclose(
        dequantize_q8_0(qs, d)[0, :2],
        [127 * float(np.float16(0.01)), -64 * float(np.float16(0.01))],
    )


def test_q8_0_zero_block_and_error_bound():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 96)).astype(np.float32)
    w[0, :32] = 0
    qs, d = quantize_q8_0(w)
    assert (qs[0, :32] == 0).all() and d[0, 0] == 0
    err = np.abs(dequantize_q8_0(qs, d) - w).reshape(8, 3, 32).max(-1)
    amax = np.abs(w).reshape(8, 3, 32).max(-1)
    assert (err <= amax / 127 * 0.51 + 1e-3 * amax).all()
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q8_0(np.zeros((2, 33), np.float32))


@pytest.mark.parametrize("bits", [4, 8])
def test_affine_equals_mlx(bits):
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(bits)
    w = (rng.standard_normal((48, 256)) * 0.05).astype(np.float32)
    w[0, :32] = -np.abs(w[0, :32])  # all-negative group: negative scale branch
    w[1, :32] = np.abs(w[1, :32])
    w[2, :32] = 0.0
    p, s, b = quantize_affine(w, bits, 32)
    mq, ms, mb = mx.quantize(mx.array(w), group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(mq), p)
    np.testing.assert_array_equal(np.array(ms), s)
    np.testing.assert_array_equal(np.array(mb), b)
    ref = np.array(mx.dequantize(mq, ms, mb, group_size=32, bits=bits))
    np.testing.assert_array_equal(dequantize_affine(p, s, b, bits, 32), ref)


def test_pack_layout_lsb_first():
    q = np.arange(8, dtype=np.uint32)[None]  # element j in bits 4j..4j+3
    assert pack(q, 4)[0, 0] == sum(j << (4 * j) for j in range(8))
    np.testing.assert_array_equal(unpack(pack(q, 4), 4), q)
