"""The L2 weight prefetch of decode attention (kernels/l2_prefetch.py): which bytes it names, and
on a GPU that it changes no result. Where it sits in the compiled kernel (before the PDL wait) is
checked offline in test_attention_compile.py."""

from __future__ import annotations

import pytest

from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams

torch = pytest.importorskip("torch")

from kipp_cuda.kernels.l2_prefetch import budget_bytes, weight_ranges  # noqa: E402
from kipp_cuda.layers import AffineLinear, DenseLinear  # noqa: E402


def _affine(rows: int, cols: int) -> AffineLinear:
    wq = torch.zeros(rows, cols // 8, dtype=torch.int32)  # 4 bytes a row per 8 columns
    s = torch.zeros(rows, cols // 32, dtype=torch.bfloat16)
    return AffineLinear(wq, s, s.clone(), 4, 32)


def test_ranges_take_whole_modules_then_a_prefix_of_each_half():
    o = _affine(64, 256)  # wq 64 x 128 bytes, scale_bias 64 x 32 bytes: 10,240 bytes
    gate_up = _affine(128, 256)  # 20,480 bytes; its gate rows 0-63, up rows 64-127
    wq, sb = gate_up.wq, gate_up.scale_bias
    # o whole, then a quarter of gate_up: 16 gate rows and 16 up rows of each tensor
    got = weight_ranges([(o, 1), (gate_up, 2)], 10_240 + 5_120)
    assert got == [
        (o.wq.data_ptr(), 64 * 128),
        (o.scale_bias.data_ptr(), 64 * 32),
        (wq.data_ptr(), 16 * 128),
        (wq.data_ptr() + 64 * 128, 16 * 128),
        (sb.data_ptr(), 16 * 32),
        (sb.data_ptr() + 64 * 32, 16 * 32),
    ]
    # a budget below the first module takes the same prefix of its rows from each tensor
    half = weight_ranges([(o, 1), (gate_up, 2)], 5_120)
    assert half == [(o.wq.data_ptr(), 32 * 128), (o.scale_bias.data_ptr(), 32 * 32)]
    assert weight_ranges([(o, 1)], 0) == []


def test_dense_weights_and_the_budget_off_a_gpu():
    w = DenseLinear(torch.zeros(8, 16, dtype=torch.bfloat16))
    assert weight_ranges([(w, 1)], 1 << 20) == [(w.weight.data_ptr(), 8 * 16 * 2)]
    assert budget_bytes(torch.device("cpu")) == 0  # no prefetch where kernels do not run


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (graphs, PTX)")
@pytest.mark.parametrize("quant", [None, "q8_0", "affine4"])
@pytest.mark.parametrize("at", ["start", "end"])
def test_gpu_decode_with_the_prefetch_equals_without(tiny_path, monkeypatch, quant, at):
    """A prefetch moves bytes into L2 and computes nothing: decode through CUDA graphs gives the
    same tokens and logprobs, bit for bit, with it (at the kernel's start or end) and without it."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    prompts = [list(range(3, 3 + n)) for n in (1, 37, 130)]
    monkeypatch.setenv("KIPP_CUDA_L2_PREFETCH_AT", at)
    monkeypatch.setenv("KIPP_CUDA_L2_PREFETCH_MB", "64")
    kw = dict(backend="cuda", dtype="bfloat16", quant=quant, kv_cache_memory="2GiB")
    on = LLM(str(tiny_path), **kw)
    layer = on.engine.backend.model.layers[0]
    assert layer.l2_table(torch.device("cuda")) is not None
    got = on.generate(prompts, params)
    monkeypatch.setenv("KIPP_CUDA_L2_PREFETCH_MB", "0")
    off = LLM(str(tiny_path), **kw)
    want = off.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
