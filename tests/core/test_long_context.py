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

    yarn_2x = {"rope_type": "yarn", "factor": 2.0}
    llm = LLM("kipp-tiny", rope_scaling=yarn_2x, max_model_len=8192)
    assert llm.config.rope_scaling["original_max_position_embeddings"] == 4096
    assert llm.engine.max_model_len == 8192 and llm.backend.config is llm.config
    with pytest.raises(ValueError, match="kipp-tiny, which has no YaRN recipe"):
        LLM("kipp-tiny", max_model_len=8192)
    # a draft model runs every position the target does, so it gets the same RoPE
    spec = LLM("kipp-tiny", speculative_model="kipp-tiny", rope_scaling=yarn_2x).engine.spec
    assert spec.config.draft_backend.config.max_position_embeddings == 8192


# -- the engine at 131,072 tokens: scheduler, block manager and prefix cache, no forward ---------


class NoOpBackend:
    """The backend contract with no model (scripts/engine_overhead.py): every sample is token 5."""

    def __init__(self, inner):
        self.config, self.block_size, self.num_blocks = (
            inner.config,
            inner.block_size,
            inner.num_blocks,
        )
        self.num_hidden_slots = inner.num_hidden_slots
        self.steps: list[int] = []  # tokens of each step

    def execute(self, batch):
        from kipp_core.backend import SeqOutput

        self.steps.append(batch.num_tokens)
        return [SeqOutput(token_ids=[5]) for _ in batch.seqs]


def test_engine_at_131k_tokens(make_checkpoint):
    import numpy as np

    from kipp_core.llm import LLM
    from kipp_core.sampling import SamplingParams
    from tests.conftest import small_config

    cfg = small_config(vocab_size=512, max_position_embeddings=32768).with_rope_scaling(
        {"rope_type": "yarn", "factor": 4.0}
    )
    n = 131072
    llm = LLM(str(make_checkpoint(cfg, seed=1)), num_kv_blocks=n // 32 * 3 // 2)
    assert llm.engine.max_model_len == n
    eng, bm = llm.engine, llm.engine.block_manager
    eng.backend = backend = NoOpBackend(eng.backend)
    prompt = np.random.default_rng(0).integers(0, 512, n - 8).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == [5] * 8 and out.metrics.num_cached_tokens == 0
    # chunked prefill under the 8,192-token budget, then one decode a step
    assert backend.steps == [8192] * 15 + [n - 8 - 15 * 8192] + [1] * 7
    bm.check_all_free()
    # the same prompt: a prompt-end hit (no layer runs); a new last token: every full block hits
    again = llm.generate([prompt], params)[0].metrics
    assert again.num_cached_tokens == len(prompt)
    edited = llm.generate([prompt[:-1] + [7]], params)[0].metrics
    assert edited.num_cached_tokens == (len(prompt) - 1) // 32 * 32
    # two full contexts in a pool of one and a half: the second waits or is preempted, both finish
    outs = llm.generate([prompt[::-1], prompt[1:] + [9]], params)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    bm.check_all_free()
    with pytest.raises(ValueError, match="131072"):  # prompt plus max_tokens past the context
        llm.generate([prompt + [1] * 8], params)
