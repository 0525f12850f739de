"""Build the MLX model from a checkpoint: HF names map one to one onto the model's parameters.

Quantization is a module swap after the float model is built: affine 4/8-bit (group 32) through
mx.quantize at load, or loaded as stored from a quantized checkpoint (no requantizing); q8_0
through its kernel where the ladder accepts one, else converted exactly to affine 8-bit.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from kipp_core.checkpoint import Checkpoint
from kipp_core.quant import SCHEMES, check_scheme
from kipp_core.safetensors_file import RawTensor
from kipp_mlx.kernels import ladder
from kipp_mlx.layout import set_module, use_cpu_layout
from kipp_mlx.model import Model
from kipp_mlx.quant import AffineEmbedding, AffineLinear, Q8Embedding, Q8Linear, quantize_q8_0

log = logging.getLogger("kipp")


def to_mx(raw: RawTensor, dtype=None) -> mx.array:
    """A stored tensor as an MLX array; float tensors cast to `dtype` when given."""
    if raw.dtype == "BF16":
        a = mx.array(raw.data).view(mx.bfloat16)
    else:
        a = mx.array(raw.data)
    if dtype is not None and raw.dtype in ("F64", "F32", "F16", "BF16"):
        a = a.astype(dtype)
    return a


def disk_scheme(ckpt: Checkpoint) -> tuple[str, int, int] | None:
    """(scheme, bits, group_size) of a quantized checkpoint, or None."""
    q = ckpt.quantization
    if not q:
        return None
    scheme = q.get("scheme")
    if scheme is None and q.get("mode", "affine") == "affine":  # mlx-lm's form
        scheme = f"affine{q.get('bits')}"
    bits, gs = check_scheme(scheme)
    return scheme, int(q.get("bits", bits)), int(q.get("group_size", gs))


def resolve_scheme(ckpt: Checkpoint, quant: str | None) -> tuple[str, int, int, bool] | None:
    """(scheme, bits, group_size, on_disk) for this load, or None for float weights."""
    disk = disk_scheme(ckpt)
    if quant is not None and quant not in SCHEMES:
        raise ValueError(f"quant must be one of {', '.join(SCHEMES)} or None, got {quant!r}")
    if disk is not None:
        if quant is not None and quant != disk[0]:
            raise ValueError(
                f"quant {quant!r} was asked for, but {ckpt.path} is already quantized as "
                f"{disk[0]!r}; load it without quant or from a float checkpoint"
            )
        return (*disk, True)
    if quant is None:
        return None
    return (quant, *SCHEMES[quant], False)


def load_model(
    ckpt: Checkpoint,
    dtype,
    quant: str | None = None,
    *,
    compile_act: bool = True,
    cpu_layout: bool | None = None,
) -> Model:
    """The model with every parameter materialized. `cpu_layout` None: on when MLX runs on the CPU
    and the weights are dense."""
    cfg = ckpt.config
    model = Model(cfg, compile_act)
    scheme = resolve_scheme(ckpt, quant)
    targets = quantized_modules(model) if scheme else []
    skip = {p + ".weight" for p in targets}
    params = dict(tree_flatten(model.parameters()))
    weights = []
    for name, p in params.items():
        if name in skip:
            continue
        a = to_mx(ckpt.raw(name), dtype)
        if a.shape != p.shape:
            raise ValueError(
                f"checkpoint {ckpt.path}: tensor {name!r} has shape {list(a.shape)}, "
                f"config.json implies {list(p.shape)}"
            )
        weights.append((name, a))
    model.load_weights(weights, strict=False)
    if scheme:
        _quantize(model, ckpt, targets, dtype, *scheme)
    mx.eval(model.parameters())
    if cpu_layout is None:
        cpu_layout = mx.default_device() == mx.cpu and not scheme
    if cpu_layout:
        use_cpu_layout(model, cfg.tie_word_embeddings)
    return model


def quantized_modules(model: Model) -> list[str]:
    """Paths of the embedding, the head and the seven linears of each layer."""
    return [p for p, m in model.named_modules() if type(m) in (nn.Linear, nn.Embedding)]


def _quantize(model, ckpt, targets, dtype, scheme, bits, group_size, on_disk) -> None:
    matmul, is_kernel = (None, False)
    if scheme == "q8_0":
        matmul, is_kernel = ladder.q8_0_matmul_fn(dtype)
        if not is_kernel:
            log.info("q8_0 weights run as MLX affine 8-bit (group 32): converted exactly at load")
    for path in targets:
        name = path + ".weight"
        is_embed = path.endswith("embed_tokens")
        if on_disk:
            parts = [to_mx(ckpt.raw(name))]
            parts.append(to_mx(ckpt.raw(path + ".scales")))
            if scheme != "q8_0":
                parts.append(to_mx(ckpt.raw(path + ".biases")))
        else:
            # q8_0 quantizes the stored values in float32, as kipp_core.quant does.
            w = to_mx(ckpt.raw(name), mx.float32 if scheme == "q8_0" else dtype)
            if w.shape[-1] % group_size:
                raise ValueError(
                    f"quant {scheme!r} needs rows divisible by {group_size}; "
                    f"{name} has {w.shape[-1]}"
                )
            parts = list(
                quantize_q8_0(w)
                if scheme == "q8_0"
                else mx.quantize(w, group_size=group_size, bits=bits)
            )
        if scheme != "q8_0" and mx.default_device() == mx.cpu:
            parts[1:] = [a.astype(mx.float32) for a in parts[1:]]  # see AffineLinear
        if scheme == "q8_0":
            m = Q8Embedding(*parts, matmul, dtype) if is_embed else Q8Linear(*parts, matmul)
            if not is_kernel:
                m = m.to_affine8()
        elif is_embed:
            m = AffineEmbedding(*parts, bits, group_size, dtype)
        else:
            m = AffineLinear(*parts, bits, group_size)
        set_module(model, path, m)
        mx.eval(m.parameters())
