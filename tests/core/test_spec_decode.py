"""Speculative decoding: greedy is token-identical to plain decoding; sampling keeps the target
distribution (checked statistically); the adaptive gate turns speculation off when it loses."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.llm import LLM
from kipp_core.sampling import SamplerState, SamplingParams, probs
from kipp_core.spec_decode import ngram_propose, verify_drafts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
REPETITIVE = [791, 7677, 374, 6303, 13, 576, 7677, 374, 6303, 13, 576, 7677, 374]


@pytest.fixture(scope="module")
def plain(tiny_path):
    return LLM(str(tiny_path))


def test_ngram_propose_hand_cases():
    assert ngram_propose([1, 2, 3, 9, 1, 2, 3], 2, 3, 1) == [9, 1]
    assert ngram_propose([5, 6, 7, 5, 8, 5], 3, 3, 1) == [8, 5]  # latest match of [5]
    assert ngram_propose([1, 2, 3], 4, 3, 1) == []


def test_ngram_greedy_is_token_identical(plain, tiny_path):
    spec = LLM(str(tiny_path), speculative="ngram", num_speculative_tokens=3)
    prompts = [REPETITIVE, REPETITIVE[:7] + [1, 2, 3], list(range(500, 530))]
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    got = [o.token_ids for o in spec.generate(prompts, GREEDY)]
    assert got == want
    assert spec.engine.spec.accepted > 0  # the check exercised acceptance, not only rejection
    spec.engine.block_manager.check_all_free()


def test_draft_model_greedy_is_token_identical(plain, tiny_path, make_checkpoint):
    from kipp_core.registry import TINY

    other = make_checkpoint(TINY.config, seed=99)
    for draft, expect_full in ((str(tiny_path), True), (str(other), False)):
        spec = LLM(str(tiny_path), speculative_model=draft, num_speculative_tokens=4)
        got = spec.generate([REPETITIVE], GREEDY)[0].token_ids
        assert got == plain.generate([REPETITIVE], GREEDY)[0].token_ids
        s = spec.engine.spec
        if expect_full:  # the model drafting for itself: every draft accepted
            assert s.accepted == s.proposed > 0
        spec.engine.block_manager.check_all_free()


def chi2_same(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson statistic of two count vectors against their pooled distribution."""
    keep = (a + b) > 0
    a, b = a[keep].astype(float), b[keep].astype(float)
    pooled = (a + b) / (a.sum() + b.sum())
    ea, eb = pooled * a.sum(), pooled * b.sum()
    return float(((a - ea) ** 2 / ea).sum() + ((b - eb) ** 2 / eb).sum()), int(keep.sum() - 1)


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_rejection_sampler_keeps_target_distribution(with_draft_probs):
    """Unit check of verify_drafts: the first emitted token is distributed as p, for drafts drawn
    from q (draft model) or fixed (prompt lookup)."""
    rng = np.random.default_rng(0)
    V = 6
    rows = rng.standard_normal((3, V)).astype(np.float32) * 1.5
    params = SamplingParams(temperature=1.0, max_tokens=8)
    st0 = SamplerState(params, seed=0)
    p = probs(rows[0], st0)
    q = rng.dirichlet(np.ones(V)).astype(np.float32)
    counts = np.zeros(V)
    n = 6000
    for seed in range(n):
        st = SamplerState(params, seed=seed)
        if with_draft_probs:
            d = int(np.random.default_rng(seed + 10**6).choice(V, p=q / q.sum()))
            dp = np.stack([q, q])
        else:
            d, dp = 2, None
        out = verify_drafts(rows, st, [d, 1], dp)
        counts[out[0]] += 1
    expected = p * n
    stat = float(((counts - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
    assert stat < 25.0  # chi-square, 5 degrees of freedom: p-value ~ 1e-4


def perturbed_tiny(make_checkpoint):
    """kipp-tiny's weights (same seed, same order) times (1 + 0.1 noise): a draft model whose
    distributions overlap the target's without being equal."""
    from kipp_core.registry import TINY
    from kipp_core.tiny import TINY_SEED, random_tensor

    noise = np.random.default_rng(123)

    def make(rng, name, shape):
        w = random_tensor(rng, name, shape)
        return w * (1 + 0.1 * noise.standard_normal(shape)).astype(np.float32)

    return make_checkpoint(TINY.config, seed=TINY_SEED, make=make)


def test_sampled_spec_decode_end_to_end_distribution(plain, tiny_path, make_checkpoint):
    """The first speculated token has the same distribution with and without draft-model
    speculation (top_k=4 keeps the support small enough to count)."""
    spec = LLM(
        str(tiny_path),
        speculative_model=str(perturbed_tiny(make_checkpoint)),
        num_speculative_tokens=2,
    )
    n = 200  # the statistic's null distribution does not depend on n; 200 samples keep its power
    base = [
        SamplingParams(temperature=1.0, top_k=4, seed=s, max_tokens=3, ignore_eos=True)
        for s in range(n)
    ]
    a = [o.token_ids[1] for o in plain.generate([REPETITIVE] * n, base)]
    b = [o.token_ids[1] for o in spec.generate([REPETITIVE] * n, base)]
    s = spec.engine.spec
    assert 0 < s.accepted < s.proposed  # both branches of the rejection sampler ran
    vocab = sorted(set(a) | set(b))
    ca = np.array([a.count(t) for t in vocab])
    cb = np.array([b.count(t) for t in vocab])
    stat, dof = chi2_same(ca, cb)
    assert stat < 3 * dof + 15


def test_adaptive_gate_turns_speculation_off(tiny_path, make_checkpoint):
    from kipp_core.registry import TINY
    from kipp_core.spec_decode import SpecConfig

    other = make_checkpoint(TINY.config, seed=7)
    llm = LLM(str(tiny_path), speculative_model=str(other), num_speculative_tokens=4)
    llm.engine.spec.config = SpecConfig(
        method="draft",
        draft_backend=llm.engine.spec.config.draft_backend,
        gate_window=8,
        min_acceptance=0.9,
    )
    eng = llm.engine
    eng.add_request(
        "g", list(range(1000, 1040)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    seq = eng.requests["g"].states[0].seq
    proposed_at_off = None
    while eng.has_unfinished_requests():
        eng.step()
        if not seq.spec_enabled and proposed_at_off is None:
            proposed_at_off = seq.spec_proposed
    assert proposed_at_off is not None and seq.spec_proposed == proposed_at_off
    assert seq.spec_accepted < 0.9 * seq.spec_proposed
