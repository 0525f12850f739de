"""Registry entries against the values quoted in QWEN3.md (hand-copied here as the outside
reference), and config checking."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kipp_core.config import ModelConfig
from kipp_core.registry import REGISTRY, check_config, lookup

# size: (hidden, intermediate, layers, heads, kv heads, tied) from QWEN3.md section 1.
QWEN3_MD = {
    "0.6B": (1024, 3072, 28, 16, 8, True),
    "1.7B": (2048, 6144, 28, 16, 8, True),
    "4B": (2560, 9728, 36, 32, 8, True),
    "8B": (4096, 12288, 36, 32, 8, False),
    "14B": (5120, 17408, 40, 40, 8, False),
    "32B": (5120, 25600, 64, 64, 8, False),
}

# The real Qwen3-0.6B config.json (QWEN3.md section 1 sources).
QWEN3_06B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize("size", list(QWEN3_MD))
@pytest.mark.parametrize("base", [False, True])
def test_entries_match_qwen3_md(size, base):
    e = lookup(f"Qwen/Qwen3-{size}" + ("-Base" if base else ""))
    assert e is not None and e.is_base == base
    h, i, n, nh, nkv, tied = QWEN3_MD[size]
    c = e.config
    assert (
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.tie_word_embeddings,
    ) == (h, i, n, nh, nkv, tied)
    assert c.head_dim == 128 and c.vocab_size == 151936 and c.rope_theta == 1e6
    assert c.rms_norm_eps == 1e-6
    assert e.context_length == (32768 if base else 40960)
    assert c.eos_token_id == (151643 if base else 151645)
    assert 151643 in e.stop_token_ids
    if not base:
        assert e.stop_token_ids == (151645, 151643)
        assert (e.sampling.temperature, e.sampling.top_p, e.sampling.top_k) == (0.6, 0.95, 20)


# Qwen3-4B-Instruct-2507's config.json, verbatim (QWEN3-2507.md section 1.1; Thinking-2507's is
# byte-identical, section 2.1), and the sampling each card recommends (sections 1.5, 2.5).
QWEN3_4B_2507_CONFIG = {
    **QWEN3_06B_CONFIG,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "max_position_embeddings": 262144,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "rope_theta": 5000000,
}
CARD_SAMPLING = {"Instruct": (0.7, 0.8, 20, 0.0), "Thinking": (0.6, 0.95, 20, 0.0)}


@pytest.mark.parametrize("kind", ["Instruct", "Thinking"])
def test_2507_entries_match_their_configs_and_cards(kind):
    e = lookup(f"Qwen/Qwen3-4B-{kind}-2507")
    assert e is lookup(f"qwen3-4b-{kind.lower()}-2507") is lookup(f"Qwen3-4B-{kind}-2507")
    check_config(ModelConfig.from_dict(QWEN3_4B_2507_CONFIG), e)
    assert e.config == ModelConfig.from_dict(QWEN3_4B_2507_CONFIG)
    assert e.context_length == e.max_context_length == 262144 and e.yarn is None
    assert e.stop_token_ids == (151645, 151643)  # generation_config.json eos_token_id
    for s in (e.sampling, e.sampling_non_thinking):  # one mode each
        assert (s.temperature, s.top_p, s.top_k, s.min_p) == CARD_SAMPLING[kind]
    assert e.chat_template == f"qwen3-{kind.lower()}-2507"
    # the original Qwen3-4B is another checkpoint: its context (and rope_theta) differ
    with pytest.raises(ValueError, match="max_position_embeddings is 262144"):
        check_config(ModelConfig.from_dict(QWEN3_4B_2507_CONFIG), lookup("qwen3-4b"))


@pytest.mark.parametrize("size", list(QWEN3_MD))
def test_yarn_recipes(size):
    # QWEN3.md: 4B-32B extend to 131,072 with factor 4 over 32,768; 0.6B and 1.7B are 32K models
    e = lookup(f"qwen3-{size.lower()}")
    assert e.max_context_length == (40960 if size in ("0.6B", "1.7B") else 131072)


def test_doc_edited_yarn_config_passes_check():
    # Qwen's docs: raise max_position_embeddings and add rope_scaling in config.json
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    d = {**QWEN3_06B_CONFIG, **dict(zip(("hidden_size", "intermediate_size"), (4096, 12288)))}
    d.update(num_attention_heads=32, num_hidden_layers=36, tie_word_embeddings=False)
    d.update(max_window_layers=36, max_position_embeddings=131072, rope_scaling=yarn)
    cfg = ModelConfig.from_dict(d)
    check_config(cfg, lookup("qwen3-8b"))
    assert cfg.max_position_embeddings == 131072 and cfg.rope_scaling["factor"] == 4.0


def test_all_fourteen_plus_tiny():
    assert len(REGISTRY) == 15
    assert lookup("qwen3-8b").repo_id == "Qwen/Qwen3-8B"
    assert lookup("QWEN3-0.6B-BASE").repo_id == "Qwen/Qwen3-0.6B-Base"
    assert lookup("nope") is None


def test_real_config_passes_check():
    cfg = ModelConfig.from_dict(QWEN3_06B_CONFIG)
    check_config(cfg, lookup("qwen3-0.6b"))


@pytest.mark.parametrize(
    "field,value",
    [
        ("num_hidden_layers", 27),
        ("rope_theta", 10000.0),
        ("tie_word_embeddings", False),
        ("head_dim", 64),
    ],
)
def test_mismatch_names_field_and_both_values(field, value):
    cfg = ModelConfig.from_dict({**QWEN3_06B_CONFIG, field: value})
    with pytest.raises(ValueError) as e:
        check_config(cfg, lookup("qwen3-0.6b"))
    msg = str(e.value)
    assert field in msg and repr(value) in msg
    want = getattr(lookup("qwen3-0.6b").config, field)
    assert repr(want) in msg


@pytest.mark.parametrize(
    "arch,mtype",
    [
        (["LlamaForCausalLM"], "llama"),
        (["Qwen2ForCausalLM"], "qwen2"),
        (["Qwen3MoeForCausalLM"], "qwen3_moe"),
    ],
)
def test_unknown_architecture_refused(arch, mtype):
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_dict({**QWEN3_06B_CONFIG, "architectures": arch, "model_type": mtype})


def test_newer_transformers_rope_parameters():
    d = dict(QWEN3_06B_CONFIG)
    d.pop("rope_theta")
    d["rope_parameters"] = {"rope_theta": 1000000, "rope_type": "default"}
    assert ModelConfig.from_dict(d).rope_theta == 1e6


def test_unimplemented_rope_rejected_clearly():
    with pytest.raises(ValueError, match="rope_scaling: rope type 'linear' is not supported"):
        ModelConfig.from_dict(
            {**QWEN3_06B_CONFIG, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
        )


def test_config_roundtrip(tmp_path):
    cfg = lookup("qwen3-8b").config
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg.to_dict()))
    assert dataclasses.astuple(ModelConfig.from_file(p))[:-1] == dataclasses.astuple(cfg)[:-1]
