"""The thinking budget on every backend and both scheduling modes: the tokens equal a reference
made one step at a time from the oracle's raw logits and the reference sampler, with the closing
tokens (`\\n</think>\\n\\n`, as the tokenizer encodes it) forced once the budget is spent. Under
async scheduling a budgeted sequence waits for its pending token near its budget, so the forced
tokens land exactly where the synchronous loop puts them; an unbudgeted sequence beside it keeps
decoding at every step."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.checkpoint import Checkpoint
from kipp_core.sampling import SamplerState, SamplingParams, sample
from kipp_core.thinking_budget import CLOSING
from oracle.qwen3 import KVCache, forward, load_weights
from tests.conformance.conftest import spy_batches

PROMPT = "<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.fixture(scope="module")
def weights(tiny_path):
    return load_weights(Checkpoint(tiny_path))


def _reference(weights, prompt, params, closing, budget) -> list[int]:
    cache = KVCache(weights.config.num_hidden_layers)
    raw = forward(weights, prompt, 0, cache)[-1]
    out: list[int] = []
    while True:
        step = len(out)
        forced = closing[step - budget] if budget <= step < budget + len(closing) else None
        st = SamplerState(params, params.seed, 0, prompt, list(out), ())
        if forced is not None:
            only = np.full_like(raw, -np.inf)
            only[forced] = raw[forced]
            tok = sample(only, st)
        else:
            tok = sample(raw, st)
        out.append(tok)
        if len(out) == params.max_tokens:
            return out
        raw = forward(weights, [tok], len(prompt) + len(out) - 1, cache)[-1]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_budgeted_tokens_equal_the_forced_reference(make_llm, weights, backend, async_scheduling):
    """(Greedy and 10 tokens on the cuda backend, whose torch references are slow on a CPU;
    else seeded, 16.)"""
    llm = make_llm(async_scheduling=async_scheduling, max_model_len=256)
    tok = llm.tokenizer
    prompt = tok.encode(PROMPT)
    cheap = backend == "cuda"
    budget = 4
    params = SamplingParams(
        temperature=0.0 if cheap else 1.0,
        seed=11,
        max_tokens=10 if cheap else 16,
        ignore_eos=True,
        thinking_token_budget=budget,
    )
    free = SamplingParams(temperature=0, max_tokens=8 if cheap else 14, ignore_eos=True)
    batches, run = spy_batches(llm, async_scheduling)
    outs = llm.generate([prompt, prompt[:-1]], [params, free])
    closing = tok.encode(CLOSING)
    want = _reference(weights, prompt, params, closing, budget)
    assert outs[0].token_ids == want
    assert want[budget : budget + 3] == closing
    ref = forward(weights, prompt[:-1])
    assert outs[1].token_ids[0] == int(np.argmax(ref[-1]))
    if run is not None:  # the free sequence decoded at every step
        free_id = max(max(b) for b in batches)
        steps = [i for i, b in enumerate(batches) if free_id in b]
        assert steps == list(range(steps[0], steps[0] + len(steps)))
