"""`kipp quantize`: the on-disk tensors equal kipp_core.quant's reference quantization of the
source, q8_0 matches a block derived by hand from ggml's quantize_row_q8_0_ref, the oracle loads
the result with logits near the float model's, and an existing --out is refused without --force."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import kipp_core.quantize_checkpoint as qc
from kipp_core.checkpoint import Checkpoint
from kipp_core.quant import is_quantized_name, quantize_affine, quantize_q8_0
from kipp_core.safetensors_file import bf16_to_f32, f32_to_bf16
from kipp_core.tiny import random_tensor
from oracle.qwen3 import forward, load_weights
from tests.conftest import rel_err, small_config

CFG = small_config(vocab_size=1024)
# One q8_0 block by hand: amax 16, so d = 16/127 = 0.1259842..., as fp16 (10 mantissa bits)
# 2^-3 * (1 + 8/1024) = 0.1259765625; qs = roundf(x * 127/16) = roundf(x * 7.9375).
HAND_X = [16, -3, 1, 2, 0, 5, -15, 7] + [0] * 24
HAND_QS = [127, -24, 8, 16, 0, 40, -119, 56] + [0] * 24
HAND_D = 0.1259765625


def _make(rng, name, shape):
    w = random_tensor(rng, name, shape)
    if name == "model.layers.0.self_attn.q_proj.weight":
        w[0, :32] = HAND_X  # exact in bf16
    return w


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from kipp_core.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("src"), CFG, seed=4, make=_make)


def test_q8_0_hand_example():
    qs, d = quantize_q8_0(np.array([HAND_X, [0.0] * 32], dtype=np.float32))
    assert qs[0].tolist() == HAND_QS and float(d[0, 0]) == HAND_D
    assert qs[1].tolist() == [0] * 32 and float(d[1, 0]) == 0.0  # ggml: id = 0 when d = 0


@pytest.mark.parametrize("scheme", ["q8_0", "affine4"])
def test_on_disk_tensors_equal_the_reference(scheme, src, tmp_path, monkeypatch):
    # Small shards and row chunks: the sharded layout and chunked quantization are exercised.
    monkeypatch.setattr(qc, "SHARD_BYTES", 40_000)
    monkeypatch.setattr(qc, "_CHUNK_ELEMS", 1000)
    r = qc.quantize_checkpoint(Checkpoint(src), tmp_path / "q", scheme)
    s, q = Checkpoint(src), Checkpoint(tmp_path / "q")
    assert (tmp_path / "q" / "model.safetensors.index.json").exists()
    assert q.quantization == {
        "scheme": scheme,
        "group_size": 32,
        "bits": 8 if scheme == "q8_0" else 4,
    }
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "q" / f).read_bytes() == (src / f).read_bytes()
    num_q = 0
    for name in s.names():
        if not is_quantized_name(name):
            raw_s, raw_q = s.raw(name), q.raw(name)
            assert raw_q.dtype == raw_s.dtype and np.array_equal(raw_q.data, raw_s.data)
            continue
        num_q += 1
        w = s.get(name)
        base = name[: -len(".weight")]
        if scheme == "q8_0":
            qs, d = quantize_q8_0(w)
            assert q.raw(name).dtype == "I8" and np.array_equal(q.raw(name).data, qs)
            assert q.raw(base + ".scales").dtype == "F16"
            assert np.array_equal(q.raw(base + ".scales").data, d)
        else:
            packed, sc, bi = quantize_affine(w, 4, 32)
            assert q.raw(name).dtype == "U32" and np.array_equal(q.raw(name).data, packed)
            for part, ref in (("scales", sc), ("biases", bi)):  # bf16, as the source
                raw = q.raw(f"{base}.{part}")
                assert raw.dtype == "BF16" and np.array_equal(raw.data, f32_to_bf16(ref))
    assert num_q == r.num_quantized == 1 + 7 * CFG.num_hidden_layers  # tied: no lm_head
    if scheme == "q8_0":
        row = q.raw("model.layers.0.self_attn.q_proj.weight").data[0, :32]
        assert row.tolist() == HAND_QS
        assert float(q.raw("model.layers.0.self_attn.q_proj.scales").data[0, 0]) == HAND_D
    assert r.dst_bytes < r.src_bytes


# Bounds on the logits' relative error against the float model. Measured on random toy checkpoints
# (seeds 4, 5): q8_0 2.2e-2, affine4 0.31-0.38, about 4x the weights' relative RMS error (5.3e-3,
# 8.1e-2), since the tied embedding enters twice and random layers amplify. A loader that read the
# layout wrong lands far above (relative error ~1.4).
BOUNDS = {"q8_0": 0.05, "affine4": 0.5}


@pytest.mark.parametrize("scheme", ["q8_0", "affine4"])
def test_oracle_loads_the_result(scheme, src, tmp_path):
    r = qc.quantize_checkpoint(Checkpoint(src), tmp_path / "q", scheme)
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, size=24).tolist()
    ref = forward(load_weights(Checkpoint(src)), ids)
    got = forward(load_weights(Checkpoint(tmp_path / "q")), ids)
    assert rel_err(got, ref) <= BOUNDS[scheme]
    # The reported error is the weights' relative RMS, recomputed here from the dequantized ones.
    s, w = Checkpoint(src), load_weights(Checkpoint(tmp_path / "q"))
    pairs = [(w.embed_tokens, s.get("model.embed_tokens.weight"))]
    for i, layer in enumerate(w.layers):
        for k in ("q_proj", "k_proj", "v_proj", "o_proj"):
            pairs.append((getattr(layer, k), s.get(f"model.layers.{i}.self_attn.{k}.weight")))
        for k in ("gate_proj", "up_proj", "down_proj"):
            pairs.append((getattr(layer, k), s.get(f"model.layers.{i}.mlp.{k}.weight")))
    err = sum(float(np.sum((a.astype(np.float64) - b) ** 2)) for a, b in pairs)
    norm = sum(float(np.sum(b.astype(np.float64) ** 2)) for _, b in pairs)
    assert r.rel_rms_error == pytest.approx(np.sqrt(err / norm), rel=1e-5)


def _kipp(*args):
    return subprocess.run(
        [sys.executable, "-m", "kipp_core.cli.main", *args], capture_output=True, text=True
    )


def test_cli_refuses_existing_out_without_force(src, tmp_path):
    out = tmp_path / "q"
    p = _kipp("quantize", "--model", str(src), "--scheme", "q8_0", "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert "size" in p.stdout and "reconstruction error" in p.stdout
    before = (out / "model.safetensors").read_bytes()
    p = _kipp("quantize", "--model", str(src), "--scheme", "affine4", "--out", str(out))
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "--force" in p.stderr
    assert (out / "model.safetensors").read_bytes() == before
    p = _kipp("quantize", "--model", str(src), "--scheme", "affine4", "--out", str(out), "--force")
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "config.json").read_text())["quantization"]["scheme"] == "affine4"
    assert not list(tmp_path.glob(".q.tmp-*"))


def test_refuses_a_quantized_source_and_other_group_sizes(src, tmp_path):
    qc.quantize_checkpoint(Checkpoint(src), tmp_path / "q", "q8_0")
    with pytest.raises(ValueError, match="already quantized"):
        qc.quantize_checkpoint(Checkpoint(tmp_path / "q"), tmp_path / "q2", "q8_0")
    with pytest.raises(ValueError, match="group size 64"):
        qc.quantize_checkpoint(Checkpoint(src), tmp_path / "q3", "affine4", group_size=64)


def test_bf16_scales_roundtrip_helper():
    x = np.array([1.0, -0.5, 3.1415927], dtype=np.float32)
    assert np.array_equal(bf16_to_f32(f32_to_bf16(x))[:2], x[:2])


@pytest.fixture(scope="module")
def src_f32(tmp_path_factory):
    from kipp_core.tiny import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("src32"), CFG, seed=4, dtype="float32")


@pytest.mark.parametrize("backend", ["cuda", "mlx"])
@pytest.mark.parametrize("scheme", ["q8_0", "affine4"])
@pytest.mark.parametrize("source", ["bfloat16", "float32"])
def test_gpu_backends_load_the_result(backend, scheme, source, src, src_f32, tmp_path):
    """In float32 a backend computes what the oracle computes from the same stored values."""
    import importlib.util

    if importlib.util.find_spec(f"kipp_{backend}.backend") is None:
        pytest.skip(f"the {backend} backend is not available here")
    if backend == "cuda":
        pytest.importorskip("torch")  # without a GPU the cuda backend runs its torch references
    from kipp_core.llm import LLM

    qc.quantize_checkpoint(
        Checkpoint(src if source == "bfloat16" else src_f32), tmp_path / "q", scheme
    )
    ids = np.random.default_rng(2).integers(0, CFG.vocab_size, size=20).tolist()
    ref = forward(load_weights(Checkpoint(tmp_path / "q")), ids)
    got = LLM(str(tmp_path / "q"), backend=backend, dtype="float32").logits(ids)
    assert rel_err(got, ref) <= 1e-4
