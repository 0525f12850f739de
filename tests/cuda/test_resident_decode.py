"""Resident decode inputs (kipp_cuda/resident.py, on by default; KIPP_CUDA_RESIDENT_DECODE=0
turns it off): a steady decode step replays its graph with no upload before it and takes its
tokens from the host ring that the graph's step_advance wrote. Against the eager runner's
synchronous loop (CPU, stand-in graphs) and, on a GPU, against the same graphs with it off (every
step uploads and copies its tokens back)."""

from __future__ import annotations

import pytest
import torch

from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from kipp_cuda.resident import ResidentDecode
from tests.cuda.test_runner_staging import _prompts, staged  # noqa: F401 (a fixture)

P = SamplingParams
LONG = [
    P(temperature=0, max_tokens=21, ignore_eos=True),
    P(temperature=0, max_tokens=6, ignore_eos=True),  # finishes first: the rows shift
    P(temperature=0, max_tokens=17, ignore_eos=True),
]


def _spy(runner, monkeypatch):
    """Count, per decode replay, whether it uploaded, and the ring reads."""
    log = {"replays": [], "reads": 0}
    replay, upload = runner._replay, runner.inputs.upload
    uploaded = []

    def spy_upload(b):
        uploaded.append(b)
        return upload(b)

    def spy_replay(key, pending, ids, positions, *rest):
        before = len(uploaded)
        out = replay(key, pending, ids, positions, *rest)
        if key[0] == "decode":
            log["replays"].append((positions.copy(), len(uploaded) > before))
        return out

    read = ResidentDecode.read

    def spy_read(self, replay_index, k):
        log["reads"] += 1
        return read(self, replay_index, k)

    runner._replay, runner.inputs.upload = spy_replay, spy_upload
    monkeypatch.setattr(ResidentDecode, "read", spy_read)
    return log


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setenv("KIPP_CUDA_RESIDENT_DECODE", "1")


def test_steady_steps_replay_without_uploads(staged, llm_factory, monkeypatch, on):  # noqa: F811
    """Block size 8: every row's position reaching a multiple of 8 starts a new block, so that
    step uploads; the steps between run on the inputs the last graph advanced, and the tokens
    equal the eager runner's synchronous loop."""
    prompts = _prompts(len(LONG))
    eager = llm_factory("cuda", dtype="float32", block_size=8, async_scheduling=False)
    want = [o.token_ids for o in eager.generate(prompts, LONG)]
    llm = staged()
    log = _spy(llm.engine.backend.runner, monkeypatch)
    assert [o.token_ids for o in llm.generate(prompts, LONG)] == want
    skipped = [pos for pos, up in log["replays"] if not up]
    assert len(skipped) >= 10 and log["reads"] >= 10
    for pos in skipped:  # no row entered a new block, and the batch did not change
        assert (pos % 8 != 0).all()
    # a step at which some row starts a block cannot have skipped its upload
    assert all(up for pos, up in log["replays"] if (pos % 8 == 0).any())


def test_on_by_default(monkeypatch):
    monkeypatch.delenv("KIPP_CUDA_RESIDENT_DECODE", raising=False)
    assert ResidentDecode(2, 8, torch.device("cpu")).enabled


@pytest.mark.parametrize("value", ["0", "false", "no", " 0 "])
def test_the_switch_spellings_that_turn_it_off(monkeypatch, value):
    monkeypatch.setenv("KIPP_CUDA_RESIDENT_DECODE", value)
    assert not ResidentDecode(2, 8, torch.device("cpu")).enabled


def test_off_by_the_switch(staged, llm_factory, monkeypatch):  # noqa: F811
    """Off, every decode replay uploads its inputs and no ring is read (one spelling end to end:
    the others are the test above)."""
    monkeypatch.setenv("KIPP_CUDA_RESIDENT_DECODE", "0")
    prompts = _prompts(2)
    eager = llm_factory("cuda", dtype="float32", block_size=8, async_scheduling=False)
    want = [o.token_ids for o in eager.generate(prompts, LONG[:2])]
    llm = staged()
    log = _spy(llm.engine.backend.runner, monkeypatch)
    assert [o.token_ids for o in llm.generate(prompts, LONG[:2])] == want
    assert log["replays"] and all(up for _, up in log["replays"]) and log["reads"] == 0


def test_sampled_rows_keep_the_copy_back(staged, llm_factory, monkeypatch, on):  # noqa: F811
    """A seeded sampled row beside greedy ones: the ring holds the argmax, not the sample, so
    those steps copy their tokens back; the inputs may still stay on the device."""
    params = [LONG[0], P(temperature=0.9, seed=5, max_tokens=15, ignore_eos=True)]
    prompts = _prompts(2)
    eager = llm_factory("cuda", dtype="float32", block_size=8, async_scheduling=False)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    llm = staged()
    log = _spy(llm.engine.backend.runner, monkeypatch)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    two_rows = [pos for pos, _ in log["replays"] if len(pos) == 2]
    assert two_rows and any(not up for pos, up in log["replays"] if len(pos) == 2)
    # ring reads only once the sampled row has finished (its 15 tokens): the greedy row alone
    assert log["reads"] <= len(log["replays"]) - len(two_rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
@pytest.mark.parametrize("quant", [None, "affine4"])
def test_gpu_resident_decode_equals_uploads(tiny_path, monkeypatch, quant, on):
    """On the GPU (pinned ring written through UVA, inputs advanced in the graph): tokens and
    logprobs bit for bit those of the same graphs with every step uploading, batch 1 (the head
    argmax) and batch 3, with a sampled row; and steady steps did skip their uploads."""
    params = [
        P(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
        P(temperature=0.8, seed=1, max_tokens=25, ignore_eos=True),
        P(temperature=0, max_tokens=33, ignore_eos=True),
    ]
    prompts = [list(range(3, 3 + n)) for n in (1, 37, 130)]
    kw = dict(backend="cuda", dtype="bfloat16", quant=quant, kv_cache_memory="1GiB")
    on = LLM(str(tiny_path), **kw)
    log = _spy(on.backend.runner, monkeypatch)
    got = on.generate(prompts, params) + on.generate(prompts[2:], params[2:])
    monkeypatch.setenv("KIPP_CUDA_RESIDENT_DECODE", "0")
    off = LLM(str(tiny_path), **kw)
    want = off.generate(prompts, params) + off.generate(prompts[2:], params[2:])
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs
    assert sum(not up for _, up in log["replays"]) >= 20 and log["reads"] >= 20
