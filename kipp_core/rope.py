"""Rotary position embedding: the parameters a config gives and the frequencies they make.

Two types: the default RoPE and static YaRN, each computed as transformers computes it
(`modeling_rope_utils._compute_default_rope_parameters` / `_compute_yarn_parameters`), in the
working dtype: the inverse-frequency blend, then `cos(pos * inv_freq) * attention_factor` (and sin)
before any cast. An explicit `factor` wins over max_position_embeddings / original (transformers
4.56 and later; 4.51-4.55 took the ratio instead, huggingface/transformers#38224). A config is
normalized so that both readings agree: `max_position_embeddings` becomes original x factor, the
context YaRN gives (what vLLM derives), and `original_max_position_embeddings` is always set.
"""

from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger("kipp")

ROPE_TYPES = ("default", "yarn")
# transformers' yarn keys; rope_theta and the type sit beside them in a `rope_parameters` dict
YARN_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
        "partial_rotary_factor",
    }
)


def rope_type(scaling: dict | None) -> str:
    """The type a `rope_scaling` / `rope_parameters` dict names ("type" is the older key)."""
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type")) or "default"


def _number(scaling: dict, key: str, where: str, lo: float, default=None):
    v = scaling.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ValueError(f"{where}.{key} must be a number >= {lo:g}, got {v!r}")
    return v


def normalize(scaling, max_position_embeddings: int, where: str = "rope_scaling"):
    """(the YaRN dict with its type, factor and original length set, or None for the default
    RoPE; the context it gives). ValueError naming the field for a type Kipp does not implement
    or a bad value."""
    if scaling is None or scaling == {}:
        return None, max_position_embeddings
    if not isinstance(scaling, dict):
        raise ValueError(f"{where} must be a JSON object or null, got {scaling!r}")
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"{where}: rope type {kind!r} is not supported (Kipp implements "
            f"{' and '.join(ROPE_TYPES)})"
        )
    prf = _number(scaling, "partial_rotary_factor", where, 0.0, 1.0)
    if prf != 1.0:
        raise ValueError(f"{where}.partial_rotary_factor {prf!r} is not supported (only 1.0)")
    if kind == "default":
        return None, max_position_embeddings
    unknown = sorted(set(scaling) - YARN_KEYS)
    if unknown:
        log.warning("%s: ignoring keys %s that YaRN does not read", where, ", ".join(unknown))
    original = _number(scaling, "original_max_position_embeddings", where, 1)
    if original is not None and not isinstance(original, int):
        raise ValueError(f"{where}.original_max_position_embeddings must be an integer")
    original = original or max_position_embeddings
    factor = _number(scaling, "factor", where, 1.0)
    if factor is None:  # transformers 5: the ratio when no factor is given
        factor = max_position_embeddings / original
        if factor < 1.0:
            raise ValueError(f"{where}: no factor, and max_position_embeddings < original")
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        _number(scaling, key, where, 0.0)
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"{where}.truncate must be true or false, got {truncate!r}")
    out = {k: v for k, v in scaling.items() if k in YARN_KEYS - {"type", "rope_theta"}}
    out.update(rope_type="yarn", factor=float(factor), original_max_position_embeddings=original)
    return out, round(original * factor)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: 1, or YaRN's `attention_factor` (mscale)."""
    if rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
    return _mscale(factor)


def inv_freq(head_dim: int, theta: float, scaling: dict | None = None, dtype=np.float32):
    """The head_dim / 2 inverse frequencies in `dtype` (float32 as transformers builds them)."""
    t = np.dtype(dtype).type
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(t) / t(head_dim)
    pos_freqs = t(theta) ** exponent
    if rope_type(scaling) != "yarn":
        return (t(1.0) / pos_freqs).astype(t)
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32  # `or`: 0 falls back too, as in transformers
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=t) - t(low)) / t(high - low), 0, 1)
    extrapolation = t(1.0) - ramp.astype(t)  # 1: keep the dimension's original frequency
    inv_extrapolation = t(1.0) / pos_freqs
    inv_interpolation = t(1.0) / (t(factor) * pos_freqs)
    blend = inv_interpolation * (t(1.0) - extrapolation) + inv_extrapolation * extrapolation
    return blend.astype(t)


def cos_sin(positions, head_dim: int, theta: float, scaling: dict | None = None, dtype=np.float32):
    """cos, sin [L, head_dim] in the half-split (NeoX) layout (frequencies repeated twice), times
    the attention factor, in `dtype`."""
    t = np.dtype(dtype).type
    freqs = np.asarray(positions, dtype=t)[:, None] * inv_freq(head_dim, theta, scaling, t)[None]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb).astype(t), np.sin(emb).astype(t)
    af = attention_factor(scaling)
    if af != 1.0:
        cos, sin = cos * t(af), sin * t(af)
    return cos, sin
