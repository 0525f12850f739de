"""Quantization at load (kipp_cuda.quant, on the device) against kipp_core.quant's numpy
references, bit for bit: a stored checkpoint and one quantized at load hold the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kipp_core.quant import quantize_affine, quantize_q8_0
from kipp_cuda import quant as cq
from tests.cuda.kernel_testing import DEV


@pytest.mark.parametrize("scheme", ["q8_0", "affine4", "affine8"])
def test_quantize_at_load_equals_numpy_bit_for_bit(scheme):
    """kipp_cuda.quant (on the device, at load) against kipp_core.quant (numpy): the same ints,
    scales and biases. Rows with all-equal, all-zero and one-sided groups, and values whose
    scaled halves sit on rounding ties, beside plain random rows."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 256)).astype(np.float32) * 3
    w[0] = 0.0
    w[1] = 0.25
    w[2] = np.abs(w[2])
    w[3, :32] = np.arange(32, dtype=np.float32) / 2  # ties at every step for 8-bit groups
    w[4] = np.round(w[4] * 127) / 127  # near q8_0's grid
    parts = cq.quantize(torch.from_numpy(w).to(DEV), scheme)
    if scheme == "q8_0":
        qs, d = quantize_q8_0(w)
        np.testing.assert_array_equal(parts["weight"].cpu().numpy(), qs)
        np.testing.assert_array_equal(parts["scales"].cpu().numpy(), d)
        return
    bits = int(scheme[-1])
    wq, s, b = quantize_affine(w, bits, 32)
    np.testing.assert_array_equal(parts["weight"].cpu().numpy().view(np.uint32), wq)
    np.testing.assert_array_equal(parts["scales"].cpu().numpy(), s)
    np.testing.assert_array_equal(parts["biases"].cpu().numpy(), b)
