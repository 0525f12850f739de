"""Deterministic noise for sampling: a pure function of (seed, stream, step, salt, index), so a
seeded request samples the same tokens whatever else shares its batch, and device samplers can
reproduce it bit for bit."""

from __future__ import annotations

import numpy as np

_F32 = np.float32

#
# All arithmetic is on uint32 (wrap-around). fmix32 is MurmurHash3's finalizer:
#   h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16
# Keys (host side, per row):
#   s = seed mod 2**64; words = (s & M, s >> 32, stream & M, step & M, salt & M), M = 0xFFFFFFFF
#   absorb(k, w) = fmix32((k ^ w) * 0x9E3779B1 + 0x7F4A7C15)
#   k1 = fold absorb over words starting from 0x243F6A88; k2 = the same from 0xB7E15162
# Per element i = 0..n-1 (device side):
#   h = fmix32(k1 ^ fmix32(i * 0x9E3779B9 + k2))
#   u = (float32(h >> 9) + 0.5) * 2**-23      (float32, exact: u is in [2**-24, 1 - 2**-24])
# 23 bits, not 24: float32(2**24 - 1) + 0.5 rounds up to 2**24, which would give u == 1 and an
# infinite Gumbel noise. In torch (no uint32 multiply) use int64 and mask with & M after each op.

M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_ABSORB_MUL, _ABSORB_ADD = 0x9E3779B1, 0x7F4A7C15
_IDX_MUL = 0x9E3779B9
_KEY1_INIT, _KEY2_INIT = 0x243F6A88, 0xB7E15162


def fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer over a uint32 array (wrap-around arithmetic)."""
    h = np.asarray(h, dtype=np.uint32)
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(_C1)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(_C2)
    return h ^ (h >> np.uint32(16))


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * _C1) & M32
    h ^= h >> 13
    h = (h * _C2) & M32
    return h ^ (h >> 16)


def noise_keys(seed: int, stream: int, step: int, salt: int = 0) -> tuple[int, int]:
    """The two uint32 keys of one noise row (see the algorithm comment above)."""
    s = seed & _M64
    words = (s & M32, s >> 32, stream & M32, step & M32, salt & M32)
    keys = []
    for k in (_KEY1_INIT, _KEY2_INIT):
        for w in words:
            k = _fmix32_int(((k ^ w) * _ABSORB_MUL + _ABSORB_ADD) & M32)
        keys.append(k)
    return keys[0], keys[1]


def uniform(seed: int, stream: int, step: int, n: int, salt: int = 0) -> np.ndarray:
    """`n` float32 values in (0, 1), a pure function of (seed, stream, step, salt, index)."""
    k1, k2 = noise_keys(seed, stream, step, salt)
    i = np.arange(n, dtype=np.uint32)
    h = fmix32(np.uint32(k1) ^ fmix32(i * np.uint32(_IDX_MUL) + np.uint32(k2)))
    return ((h >> np.uint32(9)).astype(_F32) + _F32(0.5)) * _F32(2.0**-23)


def gumbel(u: np.ndarray) -> np.ndarray:
    """Gumbel(0, 1) noise from uniforms in (0, 1): -log(-log(u)), float32."""
    return -np.log(-np.log(u))
