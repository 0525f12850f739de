"""Quantized weights: checkpoints stored quantized (loaded as stored) and float checkpoints
quantized at load, against the oracle run on the same dequantized weights; plus the error each
scheme adds against the float model."""

from __future__ import annotations

import dataclasses

import pytest

from kipp_core.checkpoint import Checkpoint
from kipp_core.quant import dequantize_tensor, is_quantized_name, quantize_tensor
from kipp_core.quantize_checkpoint import quantize_checkpoint
from oracle.qwen3 import forward, load_weights
from tests.conftest import nmse, rel_err, small_config
from tests.mlx.conftest import make_backend, random_ids, run_logits

CFG = small_config(
    vocab_size=512, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False
)
SCHEMES = ["affine4", "affine8", "q8_0"]
# NMSE of the quantized model's logits against the float model's on CFG, float32 (measured on
# these random weights: affine4 0.11, affine8 4e-4, q8_0 4e-4), with headroom; a broken format
# gives ~1.
NMSE_VS_FLOAT = {"affine4": 0.2, "affine8": 2e-3, "q8_0": 2e-3}


@pytest.fixture(scope="module")
def float_ckpt(make_checkpoint):
    return make_checkpoint(CFG, seed=13)


@pytest.fixture(scope="module")
def disk_ckpt(float_ckpt, tmp_path_factory):
    made = {}

    def get(scheme):
        if scheme not in made:
            out = tmp_path_factory.mktemp("q") / scheme
            made[scheme] = quantize_checkpoint(Checkpoint(float_ckpt), out, scheme).out
        return made[scheme]

    return get


def oracle_quantized_at_load(path, scheme):
    """The oracle on float32 weights put through kipp_core.quant's quantize and dequantize."""
    w = load_weights(Checkpoint(path))

    def qd(name, a):
        return (
            dequantize_tensor(quantize_tensor(a, scheme), scheme) if is_quantized_name(name) else a
        )

    layers = []
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        layers.append(
            dataclasses.replace(
                lw,
                **{
                    f.name: qd(
                        p
                        + (
                            "self_attn."
                            if "proj" in f.name and f.name[0] in "qkvo"
                            else "mlp."
                            if "proj" in f.name
                            else ""
                        )
                        + f.name
                        + ".weight",
                        getattr(lw, f.name),
                    )
                    for f in dataclasses.fields(lw)
                },
            )
        )
    embed = qd("model.embed_tokens.weight", w.embed_tokens)
    head = embed if w.config.tie_word_embeddings else qd("lm_head.weight", w.lm_head)
    return dataclasses.replace(w, layers=layers, embed_tokens=embed, lm_head=head)


IDS = random_ids(37, 512, seed=14)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_stored_checkpoint_matches_oracle(disk_ckpt, scheme):
    path = disk_ckpt(scheme)
    assert Checkpoint(path).quantization["scheme"] == scheme
    got = run_logits(make_backend(path, block_size=8), IDS, chunks=(11,))
    assert rel_err(got, forward(load_weights(Checkpoint(path)), IDS)) <= 1e-5


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_at_load_matches_oracle(float_ckpt, scheme):
    be = make_backend(float_ckpt, quant=scheme)
    got = run_logits(be, IDS)
    want = forward(oracle_quantized_at_load(float_ckpt, scheme), IDS)
    assert rel_err(got, want) <= 1e-5
    assert nmse(got, forward(load_weights(Checkpoint(float_ckpt)), IDS)) <= NMSE_VS_FLOAT[scheme]


@pytest.mark.parametrize("scheme", ["affine4", "q8_0"])
def test_half_precision_quantized(float_ckpt, disk_ckpt, scheme):
    ref = forward(load_weights(Checkpoint(disk_ckpt(scheme))), IDS)
    got = run_logits(make_backend(disk_ckpt(scheme), dtype="bfloat16"), IDS)
    assert nmse(got, ref) <= 1e-3
    got = run_logits(make_backend(float_ckpt, dtype="bfloat16", quant=scheme), IDS)
    assert nmse(got, forward(oracle_quantized_at_load(float_ckpt, scheme), IDS)) <= 1e-3


def test_bad_quant_options_raise(float_ckpt, disk_ckpt, make_checkpoint):
    with pytest.raises(ValueError, match="'int3'"):
        make_backend(float_ckpt, quant="int3")
    with pytest.raises(ValueError, match="already quantized as 'affine4'"):
        make_backend(disk_ckpt("affine4"), quant="q8_0")
    odd = make_checkpoint(
        small_config(
            vocab_size=512,
            hidden_size=80,
            num_attention_heads=10,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
        )
    )
    with pytest.raises(ValueError, match="divisible by 32"):
        make_backend(odd, quant="affine8")
