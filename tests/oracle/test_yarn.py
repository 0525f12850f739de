"""The YaRN gate: oracle logits equal transformers' at positions past the original window
(float32, relative error <= 1e-5, as the default-RoPE gate), whichever layout the config uses:
`rope_scaling` with `rope_type` or the older `type`, or transformers 5's `rope_parameters`. A rope
type Kipp does not implement is refused in every layout."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kipp_core.checkpoint import Checkpoint
from kipp_core.config import ModelConfig
from kipp_core.rope import attention_factor, inv_freq
from oracle.qwen3 import forward, load_weights
from tests.conftest import rel_err, small_config, yarn_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CFG = yarn_config(vocab_size=1024, rope_theta=10000.0, num_hidden_layers=2)
PROMPT = np.random.default_rng(3).integers(0, 1024, size=200).tolist()  # positions 0..199 > 64


def _rewrite(path, tmp_path, edit) -> str:
    """A copy of the checkpoint at `path` whose config.json is edit(config dict)."""
    import shutil

    out = tmp_path / "ckpt"
    shutil.copytree(path, out)
    d = json.loads((out / "config.json").read_text())
    edit(d)
    (out / "config.json").write_text(json.dumps(d))
    return str(out)


def _legacy_type(d):  # the older "type" key, original left to max_position_embeddings
    d["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    d["max_position_embeddings"] = 64


def _rope_parameters(d):  # transformers 5: no rope_theta or rope_scaling key
    d["rope_parameters"] = {"rope_theta": d.pop("rope_theta"), **d.pop("rope_scaling")}


def _tuned(d):  # every optional key: a different ramp, no truncation, explicit mscales
    d["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 2.5,
        "original_max_position_embeddings": 64,
        "beta_fast": 8,
        "beta_slow": 2,
        "truncate": False,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    }
    d["max_position_embeddings"] = 160


LAYOUTS = {"rope_scaling": None, "type": _legacy_type, "rope_parameters": _rope_parameters}
LAYOUTS["tuned"] = _tuned


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_match_transformers_past_the_original_window(layout, make_checkpoint, tmp_path):
    path = str(make_checkpoint(CFG, seed=13))
    if LAYOUTS[layout]:
        path = _rewrite(path, tmp_path, LAYOUTS[layout])
    ck = Checkpoint(path)
    assert ck.config.yarn and ck.config.max_position_embeddings >= 160
    ours = forward(load_weights(ck), PROMPT)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].numpy()
    assert rel_err(ours, ref) <= 1e-5
    # the default RoPE is far off at these positions: the gate sees YaRN
    plain = Checkpoint(path)
    plain.config = plain.config.with_rope_scaling(None)
    assert rel_err(forward(load_weights(plain), PROMPT), ref) > 1e-2


def test_frequencies_match_transformers():
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for scaling in (CFG.rope_scaling, {**CFG.rope_scaling, "factor": 1.5, "beta_fast": 4}):
        d = {**CFG.to_dict(), "rope_scaling": scaling}
        ref, ref_af = ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config(**d), "cpu")
        # Both build the frequencies in float32 from a pow (torch's is an ulp off at some inputs,
        # numpy's correctly rounded) and four rounded operations of the blend; transformers 5.24
        # differs from numpy by up to 2 ulps, so 4 bounds it (1 + four half-ulp roundings).
        ours, want = inv_freq(32, 10000.0, scaling), ref.numpy()
        assert (np.abs(ours - want) <= 4 * np.spacing(np.abs(want))).all()
        assert attention_factor(scaling) == ref_af
    assert attention_factor(CFG.rope_scaling) == 0.1 * math.log(4.0) + 1.0


def _config(**kw) -> dict:
    d = small_config().to_dict()
    d.update(kw)
    return d


@pytest.mark.parametrize(
    "where,rope",
    [
        ("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}),
        ("rope_scaling", {"rope_type": "longrope", "factor": 2.0}),
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0}),
        ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}),
    ],
)
def test_unimplemented_rope_types_are_refused(where, rope):
    with pytest.raises(ValueError, match=f"config.json: {where}: rope type '{rope_kind(rope)}'"):
        ModelConfig.from_dict(_config(**{where: rope}))


def rope_kind(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type"))


@pytest.mark.parametrize(
    "rope,match",
    [
        ({"rope_type": "yarn", "factor": 0.5}, r"rope_scaling\.factor must be a number >= 1"),
        ({"rope_type": "yarn", "factor": "4"}, r"rope_scaling\.factor"),
        ({"rope_type": "yarn", "factor": 4, "truncate": "no"}, r"rope_scaling\.truncate"),
        ({"rope_type": "yarn", "factor": 4, "beta_fast": -1}, r"rope_scaling\.beta_fast"),
        (
            {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 1.5},
            r"original_max_position_embeddings must be an integer",
        ),
        ({"rope_type": "yarn", "factor": 4, "partial_rotary_factor": 0.5}, "partial_rotary"),
        ("yarn", "must be a JSON object"),
    ],
)
def test_bad_yarn_values_name_the_field(rope, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(_config(rope_scaling=rope))


def test_context_is_original_times_factor():
    # Qwen's model cards add rope_scaling without raising max_position_embeddings
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    d = _config(max_position_embeddings=40960, rope_scaling=yarn)
    cfg = ModelConfig.from_dict(d)
    assert cfg.max_position_embeddings == 131072
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # written back, read the same
    # a default rope_parameters (transformers 5 writes one for every model) is the default RoPE
    d = _config(rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    d.pop("rope_theta")
    d.pop("rope_scaling")
    cfg = ModelConfig.from_dict(d)
    assert not cfg.yarn and cfg.rope_theta == 5e6
