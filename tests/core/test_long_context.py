"""kipp_core.long_context: --max-model-len and --rope-scaling on a checkpoint's config, against
Qwen's documented recipe (QWEN3.md "Context length / YaRN": factor 4 over 32,768 = 131,072 for
4B-32B; fit the factor to the length used) and vLLM's refusals."""

from __future__ import annotations

import json

import pytest

from kipp_core.long_context import long_context_config
from kipp_core.registry import lookup

E8B = lookup("qwen3-8b")
QWEN_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_native_lengths_leave_the_config_alone():
    for n in (None, 1, 40960):
        assert long_context_config(E8B.config, E8B, n) is E8B.config


@pytest.mark.parametrize("n,factor", [(131072, 4.0), (65536, 2.0), (50000, 50000 / 32768)])
def test_max_model_len_past_native_turns_yarn_on(n, factor):
    cfg = long_context_config(E8B.config, E8B, n)
    assert cfg.rope_scaling == {**QWEN_YARN, "factor": factor}
    assert cfg.max_position_embeddings == n


def test_rope_scaling_override_json_or_dict():
    for value in (json.dumps(QWEN_YARN), dict(QWEN_YARN)):
        cfg = long_context_config(E8B.config, E8B, None, value)
        assert cfg.rope_scaling == QWEN_YARN and cfg.max_position_embeddings == 131072
    # and back off again: the default RoPE over the original window
    off = long_context_config(cfg, E8B, None, '{"rope_type": "default"}')
    assert not off.yarn and off.max_position_embeddings == 32768


@pytest.mark.parametrize(
    "name,n,scaling,match",
    [
        ("qwen3-8b", 131073, None, "exceeds 131,072, the longest context of qwen3-8b"),
        ("qwen3-0.6b", 65536, None, "no YaRN recipe; pass rope_scaling"),
        ("qwen3-4b-instruct-2507", 300000, None, "262,144-token context.*no YaRN recipe"),
        ("qwen3-8b", 131073, QWEN_YARN, "exceeds the 131,072 positions of this rope_scaling"),
        ("qwen3-8b", 0, None, "max_model_len must be a positive integer"),
        ("qwen3-8b", None, "{not json", "rope_scaling is not valid JSON"),
        ("qwen3-8b", None, "[4]", "rope_scaling must be a JSON object"),
        ("qwen3-8b", None, '{"rope_type": "linear"}', "rope type 'linear' is not supported"),
    ],
)
def test_refusals_name_the_field(name, n, scaling, match):
    e = lookup(name)
    with pytest.raises(ValueError, match=match):
        long_context_config(e.config, e, n, scaling)


def test_llm_and_cli_take_both(tiny_path):
    from kipp_core.llm import LLM

    llm = LLM("kipp-tiny", rope_scaling={"rope_type": "yarn", "factor": 2.0}, max_model_len=8192)
    assert llm.config.rope_scaling["original_max_position_embeddings"] == 4096
    assert llm.engine.max_model_len == 8192 and llm.backend.config is llm.config
    with pytest.raises(ValueError, match="kipp-tiny, which has no YaRN recipe"):
        LLM("kipp-tiny", max_model_len=8192)
