"""Structured outputs on every backend and both scheduling modes: the sampled tokens equal the
constrained path this engine had before masks were part of the step (what the server's backend
wrapper did, run synchronously): the oracle's raw logits, the disallowed tokens set to -inf, the
reference sampler with the request's seed; logprobs are the raw logits'. Unconstrained
sequences beside them keep the async path (they decode at every step)."""

from __future__ import annotations

import concurrent.futures as cf
import json

import jsonschema
import numpy as np
import pytest

from kipp_core.checkpoint import Checkpoint
from kipp_core.json_constraint import JsonConstraint, TokenTable
from kipp_core.json_schema import compile_schema
from kipp_core.sampling import SamplerState, SamplingParams, logprobs, sample
from kipp_core.structured_outputs import StructuredOutputs
from kipp_core.tokenizer import Tokenizer
from kipp_core.tool_constraint import ToolCallConstraint
from oracle.qwen3 import KVCache, forward, load_weights
from tests.conformance.conftest import spy_batches

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "n": {"type": "integer"}, "u": {"enum": ["C", "F"]}},
    "required": ["city", "n", "u"],
    "additionalProperties": False,
}
TOOLS = (("book", SCHEMA), ("ping", None))


@pytest.fixture(scope="module")
def table(tiny_path):
    return TokenTable(Tokenizer(tiny_path), 151936)


@pytest.fixture(scope="module")
def weights(tiny_path):
    return load_weights(Checkpoint(tiny_path))


def _params(so: StructuredOutputs | None, cheap: bool, tok) -> SamplingParams:
    quote = tok.encode('"')[0]  # the random model closes strings soon after they open
    return SamplingParams(
        temperature=0.0 if cheap else 1.0,
        seed=3,
        max_tokens=12 if cheap else 24,
        logprobs=2,
        logit_bias={quote: 8, tok.encode("}")[0]: 4},
        structured_outputs=so,
    )


def _reference(weights, prompt, params, constraint, stop) -> tuple[list[int], list[float]]:
    """The tokens (and their logprobs) of the synchronous masked path: the oracle's raw logits,
    the constraint's mask, kipp_core.sampling.sample, one step at a time."""
    cache = KVCache(weights.config.num_hidden_layers)
    raw = forward(weights, prompt, 0, cache)[-1]
    out: list[int] = []
    lps = []
    while True:
        m = constraint.allowed(0, out, stop)
        st = SamplerState(params, params.seed, 0, prompt, list(out), stop)
        tok = sample(raw if m is None else np.where(m, raw, np.float32(-np.inf)), st)
        lps.append(logprobs(raw, tok, 2).logprob)
        out.append(tok)
        if tok in stop or len(out) == params.max_tokens:
            return out, lps
        raw = forward(weights, [tok], len(prompt) + len(out) - 1, cache)[-1]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_constrained_tokens_equal_the_masked_reference(
    make_llm, weights, table, backend, async_scheduling, monkeypatch
):
    """A json_schema and a forced tool call beside a free request. (Greedy and 12 tokens on the
    cuda backend, whose torch references take ~0.2 s a step on a CPU; else seeded, 24.)"""
    llm = make_llm(async_scheduling=async_scheduling, max_model_len=256)
    tok = llm.tokenizer
    prompt = tok.encode("Book a room, answer in JSON:")
    tools = StructuredOutputs(tools=TOOLS)
    constraints = [
        lambda: JsonConstraint(table, None, compile_schema(SCHEMA)),
        lambda: ToolCallConstraint(
            table, [n for n, _ in TOOLS], tok.token_to_id("</tool_call>"), False, tools.compiled()
        ),
    ]
    cheap = backend == "cuda"
    params = [_params(so, cheap, tok) for so in (StructuredOutputs(json_schema=SCHEMA), tools)]
    free = SamplingParams(temperature=0, max_tokens=8 if cheap else 20, ignore_eos=True)
    batches, run = spy_batches(llm, async_scheduling)
    if run is not None:
        # constraints are made off the engine thread; here every one is made before the first
        # step, so the three requests start together and the interleaving below is fixed
        manager, admit = llm.engine.structured, llm.engine.structured.admit

        def admit_all(scheduler, wait=0.0):
            cf.wait([f for _, f in manager._compiling.values()], 60)
            return admit(scheduler, wait)

        monkeypatch.setattr(manager, "admit", admit_all)
    outs = llm.generate([prompt, prompt, prompt[:-1]], params + [free])
    for o, p, make in zip(outs, params, constraints):
        want, want_lps = _reference(weights, prompt, p, make(), llm.engine.stop_ids(p))
        assert o.token_ids == want
        # Two float32 paths to logits of |x| <= 12 (kipp-tiny) differ by ~1e-6 relative a
        # value, so a logprob (x_t - logsumexp(x)) by at most 2 * 12 * 1e-6 plus the sum's
        # rounding over 151,936 terms (~17 ulp relative): ~3e-5; 1e-4 leaves 3x.
        got = [lp.logprob for lp in o.outputs[0].logprobs]
        np.testing.assert_allclose(got, want_lps, rtol=0, atol=1e-4)
    if outs[0].finish_reason == "stop":
        jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    ref = forward(weights, prompt[:-1])  # the free request: greedy, unconstrained
    assert outs[2].token_ids[0] == int(np.argmax(ref[-1]))
    if run is not None:  # the free sequence decoded at every step, the constrained ones waited
        free_id = max(max(b) for b in batches)
        steps = [i for i, b in enumerate(batches) if free_id in b]
        assert steps == list(range(steps[0], steps[0] + len(steps)))
        # while the free one runs; alone after it finished, a constrained one steps every step
        held = [i for i, b in enumerate(batches) if free_id - 2 in b and i <= steps[-1]]
        assert len(held) >= 3 and all(b - a == 2 for a, b in zip(held[1:], held[2:]))
