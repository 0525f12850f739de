"""Build the MLX model from a checkpoint: HF names map onto the model's parameters, except the
fused projections, whose rows are the checkpoint's matrices stacked (`FUSED`).

Quantization is a module swap after the float model is built: affine 4/8-bit (group 32) through
mx.quantize at load, or loaded as stored from a quantized checkpoint (no requantizing; a fused
projection stacks its parts' stored rows, which is exact since groups run along a row); q8_0
converted exactly to affine 8-bit, so one GEMV kernel serves both formats. Then the
ladder's kernels are attached: the decode GEMVs to the linears and the rest to the model.
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
from kipp_mlx.quant import AffineEmbedding, AffineLinear, q8_0_to_affine8, quantize_q8_0

log = logging.getLogger("kipp")

# A fused module's checkpoint parts, stacked along the output rows in this order.
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def checkpoint_names(path: str) -> list[str]:
    """The checkpoint module paths that hold `path`'s rows (itself unless it is fused)."""
    for fused, parts in FUSED.items():
        if path.endswith("." + fused):
            prefix = path[: -len(fused)]
            return [prefix + p for p in parts]
    return [path]


def read_tensor(ckpt: Checkpoint, path: str, suffix: str, dtype=None) -> mx.array:
    """`path + suffix` (".weight", ".scales", ...) from the checkpoint, its parts stacked."""
    parts = [to_mx(ckpt.raw(name + suffix), dtype) for name in checkpoint_names(path)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


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
    cpu_layout: bool | None = None,
    max_positions: int = 0,
    block_size: int = 32,
) -> Model:
    """The model with every parameter materialized. `cpu_layout` None: on when MLX runs on the CPU
    and the weights are dense. `max_positions`: the RoPE table's length (default: the model's
    context)."""
    cfg = ckpt.config
    model = Model(cfg, max_positions)
    scheme = resolve_scheme(ckpt, quant)
    targets = quantized_modules(model) if scheme else []
    skip = {p + ".weight" for p in targets}
    params = dict(tree_flatten(model.parameters()))
    weights = []
    for name, p in params.items():
        if name in skip:
            continue
        path, _, suffix = name.rpartition(".")
        a = read_tensor(ckpt, path, "." + suffix, dtype)
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
    ladder.attach(model, cfg, dtype, block_size)
    return model


def quantized_modules(model: Model) -> list[str]:
    """Paths of the embedding, the head and the four linears of each layer."""
    return [p for p, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]


def _quantize(model, ckpt, targets, dtype, scheme, bits, group_size, on_disk) -> None:
    if scheme == "q8_0":
        log.info("q8_0 weights run as MLX affine 8-bit (group 32): converted exactly at load")
        bits = 8
    for path in targets:
        is_embed = path.endswith("embed_tokens")
        if on_disk:
            parts = [read_tensor(ckpt, path, ".weight"), read_tensor(ckpt, path, ".scales")]
            if scheme != "q8_0":
                parts.append(read_tensor(ckpt, path, ".biases"))
        else:
            # q8_0 quantizes the stored values in float32, as kipp_core.quant does.
            w = read_tensor(ckpt, path, ".weight", mx.float32 if scheme == "q8_0" else dtype)
            if w.shape[-1] % group_size:
                raise ValueError(
                    f"quant {scheme!r} needs rows divisible by {group_size}; "
                    f"{path}.weight has {w.shape[-1]}"
                )
            # float32 models quantize on the CPU, whose rounding kipp_core.quant follows exactly
            with mx.stream(mx.cpu if dtype == mx.float32 else mx.default_device()):
                parts = list(
                    quantize_q8_0(w)
                    if scheme == "q8_0"
                    else mx.quantize(w, group_size=group_size, bits=bits)
                )
        if scheme == "q8_0":
            parts = list(q8_0_to_affine8(*parts))
        elif mx.default_device() == mx.cpu:
            parts[1:] = [a.astype(mx.float32) for a in parts[1:]]  # see AffineLinear
        if is_embed:
            m = AffineEmbedding(*parts, bits, group_size, dtype)
        else:
            m = AffineLinear(*parts, bits, group_size)
        set_module(model, path, m)
        mx.eval(m.parameters())
