"""The deterministic sampling noise against an independent Python implementation, MurmurHash3
vectors, and uniformity checks."""

import math

import numpy as np
import pytest

from kipp_core import sampling as S
from tests.core.sampler_state import f32

# --- Noise ----------------------------------------------------------------------------------------

M = 0xFFFFFFFF


def py_fmix32(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def py_uniform(seed, stream, step, n, salt=0):
    """The documented algorithm, in Python integers and float32 numpy scalars."""
    s = seed % 2**64
    words = [s % 2**32, s // 2**32, stream % 2**32, step % 2**32, salt % 2**32]
    keys = []
    for k in (0x243F6A88, 0xB7E15162):
        for w in words:
            k = py_fmix32(((k ^ w) * 0x9E3779B1 + 0x7F4A7C15) % 2**32)
        keys.append(k)
    out = []
    for i in range(n):
        h = py_fmix32(keys[0] ^ py_fmix32((i * 0x9E3779B9 + keys[1]) % 2**32))
        out.append((f32(h >> 9) + f32(0.5)) * f32(2.0**-23))
    return np.array(out, dtype=f32)


def test_fmix32_matches_murmur3_vectors():
    # MurmurHash3_x86_32 of the empty input with seed s is fmix32(s); published test vectors.
    h = S.fmix32(np.array([0, 1, 0xFFFFFFFF], dtype=np.uint32))
    assert h.tolist() == [0, 0x514E28B7, 0x81F16F39]


@pytest.mark.parametrize(
    "seed,stream,step,salt",
    [(0, 0, 0, 0), (1, 2, 3, 1), (2**64 - 1, 7, 10**6, 0), (-5, 0, 1, 2), (2**100 + 3, 1, 0, 0)],
)
def test_uniform_matches_independent_python(seed, stream, step, salt):
    got = S.uniform(seed, stream, step, 37, salt=salt)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, py_uniform(seed, stream, step, 37, salt))


def test_uniform_range_and_exactness():
    u = S.uniform(123, 0, 0, 1 << 16)
    assert u.min() > 0 and u.max() < 1
    k = u.astype(np.float64) * 2**23 - 0.5  # every value is (integer + 0.5) / 2**23
    np.testing.assert_array_equal(k, np.round(k))
    assert (k >= 0).all() and (k < 2**23).all()


def test_uniform_seed_is_reduced_to_64_bits_and_prefix_stable():
    np.testing.assert_array_equal(S.uniform(-1, 0, 0, 50), S.uniform(2**64 - 1, 0, 0, 50))
    np.testing.assert_array_equal(S.uniform(7, 1, 2, 50), S.uniform(7 + 2**64, 1, 2, 50))
    # Element i does not depend on n: padding the vocabulary changes nothing.
    np.testing.assert_array_equal(S.uniform(9, 0, 4, 10), S.uniform(9, 0, 4, 1000)[:10])


def chi2_uniform(u, bins=64) -> float:
    counts = np.bincount((u * bins).astype(np.int64), minlength=bins)
    expected = len(u) / bins
    return float(((counts - expected) ** 2 / expected).sum())


def check_uniform(u):
    n = len(u)
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 0.01
    assert chi2_uniform(u) < 120  # df 63: mean 63, 99.99% quantile ~ 110
    x = np.sort(u.astype(np.float64))
    ks = np.max(np.abs(np.arange(1, n + 1) / n - x))
    assert ks < 2.0 / math.sqrt(n)  # KS 99.9% critical value ~ 1.95 / sqrt(n)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / math.sqrt(n)


def test_uniform_looks_uniform_along_each_axis():
    check_uniform(S.uniform(42, 0, 0, 1 << 16))  # along the vocabulary
    check_uniform(np.array([S.uniform(s, 0, 0, 1)[0] for s in range(4000)]))  # seeds
    check_uniform(np.array([S.uniform(3, 0, t, 2)[1] for t in range(4000)]))  # steps
    check_uniform(np.array([S.uniform(3, c, 5, 3)[2] for c in range(4000)]))  # streams


def test_uniform_differs_across_keys():
    base = S.uniform(1, 0, 0, 4096)
    for other in [
        S.uniform(2, 0, 0, 4096),
        S.uniform(1 + 2**32, 0, 0, 4096),
        S.uniform(1, 1, 0, 4096),
        S.uniform(1, 0, 1, 4096),
        S.uniform(1, 0, 0, 4096, salt=1),
    ]:
        assert np.mean(base == other) < 0.01
        assert abs(np.corrcoef(base, other)[0, 1]) < 0.1
    assert len(np.unique(base)) > 4000  # indices differ too
