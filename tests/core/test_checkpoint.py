"""Checkpoint loading: sharded and single files, tied heads, dtypes, and clear errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kipp_core.checkpoint import Checkpoint
from kipp_core.safetensors_file import SafetensorsFile, bf16_to_f32, f32_to_bf16, save_file
from oracle.qwen3 import forward, load_weights
from tests.conftest import small_config

torch = pytest.importorskip("torch")

CFG = small_config(vocab_size=512, num_hidden_layers=2)


def test_bf16_conversion_matches_torch():
    x = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 100
    x[:4] = [0.0, -0.0, 1e-40, 3.0e38]
    ours = bf16_to_f32(f32_to_bf16(x))
    ref = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dtypes_load_like_safetensors_torch(dtype, make_checkpoint):
    from safetensors.torch import load_file

    path = make_checkpoint(CFG, dtype=dtype)
    ck = Checkpoint(path)
    ref = load_file(str(path / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"):
        np.testing.assert_array_equal(ck.get(name), ref[name].float().numpy())


def test_sharded_equals_single(make_checkpoint, tmp_path):
    from kipp_core.tiny import write_checkpoint

    single = make_checkpoint(CFG, seed=4)
    sharded = write_checkpoint(tmp_path / "sharded", CFG, seed=4, shard_bytes=20_000)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    ids = [1, 2, 3, 50, 60]
    a = forward(load_weights(Checkpoint(single)), ids)
    b = forward(load_weights(Checkpoint(sharded)), ids)
    np.testing.assert_array_equal(a, b)


def test_tied_with_and_without_stored_lm_head(make_checkpoint):
    plain = make_checkpoint(CFG, seed=2)
    stored = make_checkpoint(CFG, seed=2, store_tied_lm_head=True)
    assert "lm_head.weight" not in Checkpoint(plain)
    assert "lm_head.weight" in Checkpoint(stored)
    ids = [7, 8, 9]
    np.testing.assert_array_equal(
        forward(load_weights(Checkpoint(plain)), ids),
        forward(load_weights(Checkpoint(stored)), ids),
    )


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_file_named(make_checkpoint, tmp_path):
    d = copy_ckpt(make_checkpoint(CFG), tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        Checkpoint(d)


def test_missing_shard_named(tmp_path):
    from kipp_core.tiny import write_checkpoint

    d = write_checkpoint(tmp_path / "s", CFG, shard_bytes=20_000)
    victim = sorted(d.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ValueError, match=victim.name):
        Checkpoint(d)


def test_truncated_file_named(make_checkpoint, tmp_path):
    d = copy_ckpt(make_checkpoint(CFG), tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated") as e:
        Checkpoint(d)
    assert "model.safetensors" in str(e.value)


def test_corrupt_header_named(make_checkpoint, tmp_path):
    d = copy_ckpt(make_checkpoint(CFG), tmp_path / "m")
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt") as e:
        Checkpoint(d)
    assert "model.safetensors" in str(e.value)


def test_missing_tensor_named(make_checkpoint, tmp_path):
    d = copy_ckpt(make_checkpoint(CFG), tmp_path / "m")
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {
        k: (f.get(k).dtype, np.array(f.get(k).data))
        for k in f.keys()
        if k != "model.layers.1.self_attn.k_norm.weight"
    }
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        Checkpoint(d)


def test_wrong_shape_named(make_checkpoint, tmp_path):
    d = copy_ckpt(make_checkpoint(CFG), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 200
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="gate_proj"):
        Checkpoint(d)


def test_missing_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        Checkpoint(tmp_path / "m")


def test_registry_name_in_config_is_checked(make_checkpoint, tmp_path):
    d = copy_ckpt(make_checkpoint(CFG), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["_name_or_path"] = "Qwen/Qwen3-0.6B"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="vocab_size is 512, expected 151936"):
        Checkpoint(d)
