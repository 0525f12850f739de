"""The compiled decode step (kipp_mlx.decode_graph) against the eager step it replaces: logits,
the KV it writes (padding rows included), sampled tokens through LLM, and trace reuse."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kipp_core.backend import ModelInput, SeqInput
from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from kipp_mlx.decode_graph import DecodeGraph, batch_bucket, width_bucket
from tests.conftest import f32_paths_atol, small_config
from tests.mlx.conftest import make_backend, random_ids

CFG = small_config(vocab_size=512, num_attention_heads=8, num_key_value_heads=2)
MAX_LOGIT = 16.0  # above any logit of these random weights


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 17, 256, 257)] == [
        1, 2, 4, 4, 8, 8, 16, 24, 256, 264,
    ]  # fmt: skip
    assert [width_bucket(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, 128]


def _pair(path, monkeypatch, **kw):
    monkeypatch.setenv("KIPP_MLX_COMPILE", "1")
    graph = make_backend(path, **kw)
    monkeypatch.setenv("KIPP_MLX_COMPILE", "0")
    eager = make_backend(path, **kw)
    assert graph.decode_graph is not None and eager.decode_graph is None
    return graph, eager


def _decode_steps(be, prompts, tables, steps):
    """Prefill each prompt, then `steps` decode steps of a ragged batch (a row leaves each step)
    feeding fixed tokens; the logits of every decode step."""
    be.execute(ModelInput([SeqInput(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))]))
    out, lens = [], [len(p) for p in prompts]
    for k in range(steps):
        live = range(len(prompts) - k)
        batch = [
            SeqInput(i, [(7 * i + k) % 500], lens[i], tables[i], return_logits=True) for i in live
        ]
        out.append(np.concatenate([o.logits for o in be.execute(ModelInput(batch))]))
        for i in live:
            lens[i] += 1
    return out


def test_compiled_decode_equals_eager(make_checkpoint, monkeypatch):
    path = make_checkpoint(CFG, dtype="float32")
    graph, eager = _pair(path, monkeypatch)
    prompts = [random_ids(n, 512, seed=n) for n in (5, 40, 17, 33, 9)]
    tables = [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9], [10, 11]]
    got = _decode_steps(graph, prompts, tables, 5)
    want = _decode_steps(eager, prompts, tables, 5)
    # 5 rows pad to 8, 3 rows to 4: the padding rows' duplicate writes must leave row 0's KV as
    # the eager step leaves it
    atol = f32_paths_atol(MAX_LOGIT, CFG.intermediate_size + 64)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)
    for g, w in zip(graph.kv.arrays(), eager.kv.arrays()):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=0, atol=1e-5)


def test_compiled_decode_traces_once_a_bucket(make_checkpoint, monkeypatch):
    traces = []
    forward = DecodeGraph._forward

    def counted(self, *a):
        traces.append(a[0].shape[0])
        return forward(self, *a)

    monkeypatch.setattr(DecodeGraph, "_forward", counted)
    path = make_checkpoint(CFG, dtype="float32")
    graph, _ = _pair(path, monkeypatch)
    prompts = [random_ids(6, 512, seed=n) for n in range(7)]
    _decode_steps(graph, prompts, [[i] for i in range(7)], 4)  # 7, 6, 5, 4 rows
    assert traces == [8, 4]


def test_llm_greedy_tokens_equal_eager(make_checkpoint, monkeypatch):
    path = make_checkpoint(CFG, dtype="float32")
    prompts = [random_ids(n, 512, seed=n) for n in (3, 11, 30)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("KIPP_MLX_COMPILE", flag)
        llm = LLM(str(path), backend="mlx", dtype="float32", max_model_len=512)
        assert (llm.engine.backend.decode_graph is not None) == (flag == "1")
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    "env", [{"KIPP_MLX_COMPILE": "0"}, {"KIPP_MLX_DISABLE_KERNELS": "decode_graph"}]
)
def test_switched_off(make_checkpoint, monkeypatch, env):
    monkeypatch.setenv("KIPP_MLX_COMPILE", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert make_backend(make_checkpoint(CFG, dtype="float32")).decode_graph is None


def test_not_on_the_cpu_by_default(make_checkpoint, monkeypatch):
    monkeypatch.delenv("KIPP_MLX_COMPILE", raising=False)
    if mx.default_device() == mx.gpu:
        pytest.skip("MLX runs on a GPU here")
    assert make_backend(make_checkpoint(CFG, dtype="float32")).decode_graph is None


def _broken(*a):
    raise RuntimeError("no trace")


def test_a_failed_trace_falls_back_once(make_checkpoint, monkeypatch, caplog):
    from kipp_core.fastpath import clear_fallbacks

    clear_fallbacks()
    monkeypatch.delenv("KIPP_MLX_REQUIRE_KERNELS", raising=False)  # the GPU runs set it
    path = make_checkpoint(CFG, dtype="float32")
    graph, eager = _pair(path, monkeypatch)
    graph.decode_graph._fn = _broken
    prompts, tables = [random_ids(9, 512, seed=1)], [[0]]
    with caplog.at_level("WARNING", logger="kipp"):
        got = _decode_steps(graph, prompts, tables, 1)
    assert graph.decode_graph is None
    assert "decode_graph falls back" in caplog.text and "no trace" in caplog.text
    np.testing.assert_array_equal(got[0], _decode_steps(eager, prompts, tables, 1)[0])
    clear_fallbacks()


def test_a_failed_trace_is_fatal_when_kernels_are_required(make_checkpoint, monkeypatch):
    from kipp_core.fastpath import KernelUnavailableError

    graph, _ = _pair(make_checkpoint(CFG, dtype="float32"), monkeypatch)
    graph.decode_graph._fn = _broken
    monkeypatch.setenv("KIPP_MLX_REQUIRE_KERNELS", "1")
    with pytest.raises(KernelUnavailableError, match="decode_graph"):
        _decode_steps(graph, [random_ids(9, 512, seed=1)], [[0]], 1)
