"""Weight quantization formats, numpy references that every backend's kernels are checked against.

- q8_0 (ggml `quantize_row_q8_0_ref`): blocks of 32 along a row, d = amax / 127 stored as fp16,
  qs = roundf(x / d) (halves away from zero) as int8. Dequantized: qs * d.
- affine (MLX `mx.quantize`, mode "affine", the fp32 algorithm since v0.23): groups of
  `group_size` along a row, w ~= scale * q + bias with q in [0, 2^bits - 1], packed LSB-first into
  uint32; scale may be negative (QWEN3.md 6d).

On disk (`kipp quantize`), each quantized linear `<m>.weight` becomes `<m>.weight` (int8 [out, in]
for q8_0, uint32 [out, in * bits / 32] for affine), `<m>.scales` and, for affine, `<m>.biases`
([out, in / group_size]); `config.json` gains `"quantization": {"scheme", "group_size", "bits"}`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

SCHEMES = {"q8_0": (8, 32), "affine4": (4, 32), "affine8": (8, 32)}  # scheme -> (bits, group)
QK8_0 = 32


def check_scheme(scheme: str) -> tuple[int, int]:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}: choose {', '.join(SCHEMES)}")
    return SCHEMES[scheme]


def is_quantized_name(name: str) -> bool:
    """2-D weights are quantized: the embedding, the head and the seven linears of each layer."""
    return name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight")


# -- q8_0 ---------------------------------------------------------------------------------------


def _roundf(x: np.ndarray) -> np.ndarray:
    """C roundf: halves away from zero (numpy's round is half to even)."""
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def quantize_q8_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K] float32 (K % 32 == 0) -> qs int8 [..., K], d float16 [..., K / 32]."""
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % QK8_0:
        raise ValueError(f"q8_0 needs rows divisible by 32, got {w.shape[-1]}")
    blocks = w.reshape(*w.shape[:-1], -1, QK8_0)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    qs = _roundf(blocks * inv[..., None]).astype(np.int8)
    return qs.reshape(w.shape), d.astype(np.float16)


def dequantize_q8_0(qs: np.ndarray, d: np.ndarray) -> np.ndarray:
    blocks = qs.reshape(*qs.shape[:-1], -1, QK8_0).astype(np.float32)
    return (blocks * d.astype(np.float32)[..., None]).reshape(qs.shape)


# -- MLX affine ---------------------------------------------------------------------------------


def quantize_affine(w: np.ndarray, bits: int = 4, group_size: int = 32):
    """w [..., K] -> (packed uint32 [..., K * bits / 32], scales f32, biases f32 [..., K / gs]).
    Scales and biases come back in float32; MLX stores them in the weight's dtype."""
    if bits not in (4, 8) or group_size not in (32, 64, 128):
        raise ValueError(
            f"affine quantization supports bits 4/8 and group 32/64/128, got {bits}/{group_size}"
        )
    w = np.asarray(w, dtype=np.float32)
    if w.shape[-1] % group_size:
        raise ValueError(f"rows must be divisible by group_size {group_size}, got {w.shape[-1]}")
    g = w.reshape(*w.shape[:-1], -1, group_size)
    n_bins = np.float32(2**bits - 1)
    w_max, w_min = g.max(axis=-1), g.min(axis=-1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale).astype(np.float32)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(nz, edge / np.where(nz, q0, 1), scale).astype(np.float32)
    bias = np.where(nz, edge, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((g - bias[..., None]) / scale[..., None]), 0, n_bins).astype(np.uint32)
    return pack(q.reshape(w.shape), bits), scale, bias


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint values [..., K] -> uint32 [..., K * bits / 32], element j at bits (j % per) * bits."""
    per = 32 // bits
    q = q.reshape(*q.shape[:-1], -1, per).astype(np.uint32)
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    return np.bitwise_or.reduce(q << shifts, axis=-1).astype(np.uint32)


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits).astype(np.uint32)
    q = (packed[..., None] >> shifts) & np.uint32(2**bits - 1)
    return q.reshape(*packed.shape[:-1], -1)


def dequantize_affine(
    packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int
) -> np.ndarray:
    q = unpack(packed, bits).astype(np.float32)
    g = q.reshape(*q.shape[:-1], -1, group_size)
    s = scales.astype(np.float32)[..., None]
    b = biases.astype(np.float32)[..., None]
    return (g * s + b).reshape(q.shape)


# -- checkpoints --------------------------------------------------------------------------------


def quantize_tensor(w: np.ndarray, scheme: str) -> dict[str, np.ndarray]:
    """{"weight", "scales"[, "biases"]} for one float32 weight; scales as stored (fp16/f32)."""
    bits, gs = check_scheme(scheme)
    if scheme == "q8_0":
        qs, d = quantize_q8_0(w)
        return {"weight": qs, "scales": d}
    packed, s, b = quantize_affine(w, bits, gs)
    return {"weight": packed, "scales": s, "biases": b}


def dequantize_tensor(parts: dict[str, np.ndarray], scheme: str) -> np.ndarray:
    bits, gs = check_scheme(scheme)
    if scheme == "q8_0":
        return dequantize_q8_0(parts["weight"], parts["scales"])
    return dequantize_affine(parts["weight"], parts["scales"], parts["biases"], bits, gs)


def dequantized_weights(ckpt, dtype=np.float32) -> Callable[[str], np.ndarray]:
    """A getter over a quantized checkpoint that returns every weight dequantized to `dtype`."""
    q = ckpt.quantization or {}
    scheme = q.get("scheme")
    check_scheme(scheme)

    def get(name: str) -> np.ndarray:
        if not is_quantized_name(name):
            return ckpt.get(name, dtype)
        base = name[: -len(".weight")]
        parts = {"weight": ckpt.raw(name).data, "scales": ckpt.get(base + ".scales", np.float32)}
        if scheme != "q8_0":
            parts["biases"] = ckpt.get(base + ".biases", np.float32)
        return dequantize_tensor(parts, scheme).astype(dtype)

    return get
