"""Device sampling and logprobs against the numpy reference in kipp_core.sampling: exact tokens on
random logits and random parameters, logprobs within 1e-5, and the hash noise bit for bit."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kipp_core import sampling as ref
from kipp_core.sampling import SamplerState, SamplingParams
from kipp_mlx import logprobs as dev_lp
from kipp_mlx import sampler as dev
from tests.core.sampler_state import extreme_state

V = 3000


def test_noise_is_bit_identical():
    for seed, stream, step in [
        (0, 0, 0),
        (2**64 - 1, 3, 7),
        (123456789012345, 1, 2**32 + 5),
        (-5, 0, 1),
    ]:
        k1, k2 = ref.noise_keys(seed, stream, step, ref.SALT_SAMPLE)
        got = dev.uniform(mx.array([k1], dtype=mx.uint32), mx.array([k2], dtype=mx.uint32), 70001)
        want = ref.uniform(seed, stream, step, 70001, ref.SALT_SAMPLE)
        np.testing.assert_array_equal(np.array(got)[0], want)


def _logits(rng, n=V):
    x = (rng.standard_normal(n) * rng.uniform(0.5, 4)).astype(np.float32)
    kind = rng.integers(0, 4)
    if kind == 1:  # many exact ties
        x = np.round(x).astype(np.float32)
    elif kind == 2:  # masked tokens
        x[rng.integers(0, n, size=n // 3)] = -np.inf
    elif kind == 3:  # a flat tail, as padding rows give
        x[n // 2 :] = 0.0
    return x


def _params(rng) -> SamplingParams:
    pick = rng.uniform
    kw = dict(
        temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.5])),
        top_p=float(rng.choice([1.0, 0.95, 0.8, 0.3, pick(0.01, 1.0)])),
        top_k=int(rng.choice([0, -1, 1, 5, 20, 100, V - 1, V + 10])),
        min_p=float(rng.choice([0.0, 0.0, 0.05, pick(0, 0.5)])),
        repetition_penalty=float(rng.choice([1.0, 1.2, 0.8])),
        presence_penalty=float(rng.choice([0.0, 0.5, -1.0])),
        frequency_penalty=float(rng.choice([0.0, 0.3, -0.5])),
        min_tokens=int(rng.choice([0, 0, 3])),
        seed=int(rng.integers(0, 2**63)),
    )
    if rng.uniform() < 0.3:
        kw["logit_bias"] = {int(t): float(pick(-30, 30)) for t in rng.integers(0, V + 5, size=6)}
    return SamplingParams(**kw)


def _state(rng, p: SamplingParams) -> SamplerState:
    return SamplerState(
        p,
        p.seed,
        stream=int(rng.integers(0, 3)),
        prompt_token_ids=rng.integers(0, V + 3, size=int(rng.integers(1, 40))).tolist(),
        output_token_ids=rng.integers(0, V, size=int(rng.integers(0, 8))).tolist(),
        stop_token_ids=tuple(rng.integers(0, V, size=2).tolist()),
    )


@pytest.mark.parametrize("batch", [1, 7])
def test_tokens_equal_reference(batch):
    rng = np.random.default_rng(batch)
    for _ in range(240 // batch):
        x = np.stack([_logits(rng) for _ in range(batch)])
        states = [_state(rng, _params(rng)) for _ in range(batch)]
        got = dev.sample(mx.array(x), states).tolist()
        want = [ref.sample(x[i], st) for i, st in enumerate(states)]
        assert got == want, [st.params for st in states]


def test_processed_and_filtered_logits_equal_reference():
    rng = np.random.default_rng(3)
    for _ in range(60):
        x = _logits(rng)
        st = _state(rng, _params(rng).replace(temperature=0.7))
        p = dev.process_logits(mx.array(x[None]), [st])
        np.testing.assert_array_equal(np.array(p)[0], ref.process_logits(x, st))
        want = ref.filtered_logits(ref.process_logits(x, st), st.params)
        got = dev.filtered_logits(p / np.float32(0.7), [st.params], [True])
        np.testing.assert_array_equal(np.array(got)[0], want)


def test_float32_edges_equal_reference():
    """SamplingParams' float32 edges (overflowing penalties, top_p 0 in float32)."""
    rng = np.random.default_rng(8)
    for _ in range(12):
        states = [extreme_state(rng, V) for _ in range(5)]
        x = np.stack([_logits(rng) * 10 for _ in range(5)])
        got = dev.sample(mx.array(x), states).tolist()
        assert got == [ref.sample(x[i], st) for i, st in enumerate(states)]


def test_top_k_ties_past_k_take_the_full_sort():
    """top_k keeps every tie with the k-th value; top_p must then sum all of them."""
    x = np.full(V, -5.0, dtype=np.float32)
    x[:3] = [3.0, 2.0, 1.0]
    x[10:60] = 0.5  # 50 tokens tie at the 4th value
    p = SamplingParams(temperature=1.0, top_k=4, top_p=0.9, seed=1)
    for seed in range(20):
        st = SamplerState(p.replace(seed=seed), seed)
        assert dev.sample(mx.array(x[None]), [st]).tolist() == [ref.sample(x, st)]


@pytest.mark.parametrize("vocab", [V, 151936])
@pytest.mark.parametrize("one", [False, True], ids=["mixed-n", "top-1"])  # top-1: the argmax path
def test_logprobs_equal_reference(vocab, one):
    rng = np.random.default_rng(4)
    x = np.stack([_logits(rng, vocab) for _ in range(12)])
    x[0, 5:9] = x[0].max() + 1  # ties at the top
    x[1, :] = 0.0  # every token ties (the host fallback)
    toks = rng.integers(0, vocab, size=12).tolist()
    tops = [1] * 12 if one else [0, 1, 2, 5, 20, 3, 0, 7, 20, 1, 4, 2]
    got = dev_lp.token_logprobs(mx.array(x), toks, tops)
    for i, g in enumerate(got):
        w = ref.logprobs(x[i], toks[i], tops[i])
        assert (g.token_id, g.rank) == (w.token_id, w.rank)
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        np.testing.assert_allclose([v for _, v in g.top], [v for _, v in w.top], atol=1e-5)


def test_logprobs_bad_input_raises():
    with pytest.raises(ValueError, match="token_id"):
        dev_lp.token_logprobs(mx.zeros((1, 10)), [10], [0])
    with pytest.raises(ValueError, match="top_n"):
        dev_lp.token_logprobs(mx.zeros((1, 10)), [1], [-1])
