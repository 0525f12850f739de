"""The numpy sampling reference: hand-worked processing and filtering, statistics of the draws, an
independent torch implementation, and logprobs."""

import math

import numpy as np
import pytest

from kipp_core import sampling as S
from kipp_core.sampling import SamplingParams
from tests.core.sampler_state import NEG_INF, extreme_state, f32, state

# --- process_logits: hand-worked, V = 6 -----------------------------------------------------------

LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 0.0], dtype=f32)


def processed(**kw):
    return S.process_logits(LOGITS, state(**kw))


def test_logit_bias():
    got = processed(logit_bias={1: 2.0, "4": -100, 10: 5.0})  # id 10 is outside V
    np.testing.assert_array_equal(got, [2.0, 1.0, 0.5, 3.0, -102.0, 0.0])
    assert got.dtype == np.float32


def test_min_tokens_masks_stop_tokens():
    kw = dict(min_tokens=2, stop_token_ids=(3, 5, 99))
    np.testing.assert_array_equal(
        processed(output_token_ids=[1], **kw), [2.0, -1.0, 0.5, NEG_INF, -2.0, NEG_INF]
    )
    np.testing.assert_array_equal(processed(output_token_ids=[1, 1], **kw), LOGITS)


def test_repetition_penalty_over_prompt_and_output():
    got = processed(repetition_penalty=2.0, prompt_token_ids=[0, 99], output_token_ids=[1, 2, 2])
    np.testing.assert_array_equal(got, [1.0, -2.0, 0.25, 3.0, -2.0, 0.0])


def test_frequency_and_presence_over_output_only():
    got = processed(
        frequency_penalty=0.5,
        presence_penalty=0.25,
        prompt_token_ids=[4, 4],
        output_token_ids=[2, 2, 3, 42],
    )
    np.testing.assert_array_equal(got, [2.0, -1.0, -0.75, 2.25, -2.0, 0.0])
    got = processed(frequency_penalty=-1.0, presence_penalty=-2.0, output_token_ids=[0])
    np.testing.assert_array_equal(got, [5.0, -1.0, 0.5, 3.0, -2.0, 0.0])


def test_processing_order():
    # bias before repetition: (-1 + 2) / 2 = 0.5 (the other way round: -1 * 2 + 2 = 0).
    # repetition before frequency: 3 / 2 - 1 = 0.5 (the other way round: (3 - 1) / 2 = 1).
    got = processed(
        logit_bias={1: 2.0},
        repetition_penalty=2.0,
        frequency_penalty=1.0,
        prompt_token_ids=[1],
        output_token_ids=[3],
    )
    np.testing.assert_array_equal(got, [2.0, 0.5, 0.5, 0.5, -2.0, 0.0])


def test_process_logits_leaves_input_alone():
    x = LOGITS.copy()
    S.process_logits(x, state(logit_bias={0: 1.0}, repetition_penalty=3.0, prompt_token_ids=[0]))
    np.testing.assert_array_equal(x, LOGITS)


# --- filtered_logits: hand-worked -----------------------------------------------------------------

P5 = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
L5 = np.log(P5).astype(f32)


def kept(x, **kw):
    out = S.filtered_logits(x, SamplingParams(**kw))
    assert out.dtype == np.float32
    return set(np.flatnonzero(out > NEG_INF).tolist())


def test_temperature_divides():
    out = S.filtered_logits(np.array([1.0, 2.0, -1.0], dtype=f32), SamplingParams(temperature=0.5))
    np.testing.assert_array_equal(out, [2.0, 4.0, -2.0])


@pytest.mark.parametrize(
    "kw,want",
    [
        ({}, {0, 1, 2, 3, 4}),
        ({"min_p": 0.3}, {0, 1, 2}),  # prob >= 0.12
        ({"min_p": 0.5}, {0, 1}),  # prob >= 0.2
        ({"min_p": 0.8}, {0}),
        ({"min_p": 1.0}, {0}),
        ({"top_k": 2}, {0, 1}),
        ({"top_k": 5}, {0, 1, 2, 3, 4}),
        ({"top_k": 50}, {0, 1, 2, 3, 4}),
        ({"top_k": -1}, {0, 1, 2, 3, 4}),
        ({"top_p": 0.35}, {0}),
        ({"top_p": 0.65}, {0, 1}),  # 0.4 + 0.3 reaches it
        ({"top_p": 0.8}, {0, 1, 2}),  # 0.7 does not, 0.85 does
        ({"top_p": 0.9}, {0, 1, 2, 3}),
        ({"top_p": 0.97}, {0, 1, 2, 3, 4}),
        # top_p on what is left, renormalized: 0.4/0.85, 0.3/0.85 = 0.82 >= 0.8
        ({"top_k": 3, "top_p": 0.8}, {0, 1}),
        ({"min_p": 0.3, "top_p": 0.8}, {0, 1}),
        ({"min_p": 0.3, "top_k": 2}, {0, 1}),
        # temperature 2 flattens: probs sqrt(P5) / 2.107 = .300 .260 .184 .150 .106
        ({"temperature": 2.0, "top_p": 0.55}, {0, 1}),
        ({"temperature": 2.0, "top_p": 0.7}, {0, 1, 2}),
        ({"temperature": 2.0, "min_p": 0.6}, {0, 1, 2}),  # ratios 1 .866 .612 .5 .354
    ],
)
def test_filters_keep_the_hand_derived_set(kw, want):
    assert kept(L5, **kw) == want


def test_kept_values_are_the_scaled_logits():
    out = S.filtered_logits(L5, SamplingParams(temperature=0.5, top_k=2))
    np.testing.assert_array_equal(out, [L5[0] / f32(0.5), L5[1] / f32(0.5), *[NEG_INF] * 3])


def test_ties_at_the_boundary_are_kept():
    x = np.array([1.0, 3.0, 3.0, 3.0, 0.0], dtype=f32)
    assert kept(x, top_k=2) == {1, 2, 3}
    assert kept(np.zeros(4, dtype=f32), top_p=0.3) == {0, 1, 2, 3}
    # probs 0.534 0.197 0.197 0.072: 0.6 needs one of the tied pair, so both stay
    assert kept(np.array([2.0, 1.0, 1.0, 0.0], dtype=f32), top_p=0.6) == {0, 1, 2}
    assert kept(np.array([5.0, 5.0, 1.0], dtype=f32), min_p=1.0) == {0, 1}


def test_filters_with_masked_input():
    x = np.array([NEG_INF, 1.0, 0.0, NEG_INF], dtype=f32)  # probs .731 .269
    assert kept(x, top_p=0.5) == {1}
    assert kept(x, top_p=0.8, top_k=3) == {1, 2}
    assert kept(x, min_p=0.3) == {1, 2}
    assert kept(np.full(3, NEG_INF, dtype=f32), top_p=0.5, min_p=0.5) == set()


# --- sample and probs -----------------------------------------------------------------------------


def test_greedy_takes_the_lowest_id_among_ties():
    x = np.array([1.0, 3.0, 3.0, 0.0], dtype=f32)
    assert S.sample(x, state(temperature=0.0, seed=5)) == 1
    assert S.sample(x, state(temperature=1e-6, seed=6, output_token_ids=[0] * 9)) == 1


def test_greedy_sees_processed_logits():
    # Repetition penalty 4 on id 3 (3 -> 0.75) hands the argmax to id 0.
    st = state(temperature=0.0, repetition_penalty=4.0, output_token_ids=[3])
    assert S.sample(LOGITS, st) == 0
    np.testing.assert_array_equal(S.probs(LOGITS, st), [1, 0, 0, 0, 0, 0])
    assert S.sample(LOGITS, state(temperature=0.0)) == 3


def test_single_survivor_is_always_drawn():
    for seed in range(50):
        assert S.sample(L5, state(seed=seed, top_k=1, temperature=3.0)) == 0
        assert S.sample(L5, state(seed=seed, min_p=0.9)) == 0
        assert S.sample(LOGITS, state(seed=seed, logit_bias={4: 100.0})) == 4


def test_a_top_p_of_zero_in_float32_keeps_the_top_token():
    """7e-46 and 5e-324 are 0 as float32: no prefix reaches them, so only the top token stays
    (vLLM's rule), never the whole vocabulary."""
    for top_p in (7e-46, 5e-324, 1e-45):
        for seed in range(50):
            assert S.sample(L5, state(seed=seed, top_p=top_p, temperature=2.0)) == 0


def test_extreme_valid_values_never_make_nan():
    """Every value SamplingParams accepts, at its float32 edges: processed and filtered logits
    are finite or +-inf (no NaN), and a token inside the vocabulary comes out."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        st = extreme_state(rng, 64)
        logits = (rng.standard_normal(64) * 10).astype(f32)
        kw = st.params
        x = S.process_logits(logits, st)
        assert not np.isnan(x).any(), kw
        if not st.params.is_greedy:  # (filtered_logits is for random sampling only)
            assert not np.isnan(S.filtered_logits(x, st.params)).any(), kw
        assert 0 <= S.sample(logits, st) < 64
        assert not np.isnan(S.probs(logits, st)).any(), kw


def test_filtered_tokens_are_never_drawn():
    draws = {S.sample(L5, state(seed=s, top_p=0.8)) for s in range(600)}
    assert draws == {0, 1, 2}
    draws = {S.sample(L5, state(seed=s, top_k=2, temperature=5.0)) for s in range(300)}
    assert draws == {0, 1}
    draws = {S.sample(L5, state(seed=s, min_p=0.5)) for s in range(300)}
    assert draws == {0, 1}


def chi2(counts, expected_p) -> float:
    n = counts.sum()
    e = n * np.asarray(expected_p)
    mask = e > 0
    assert counts[~mask].sum() == 0
    return float(((counts[mask] - e[mask]) ** 2 / e[mask]).sum())


V8 = np.array([1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.25], dtype=f32)


def softmax64(x):
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


@pytest.mark.parametrize(
    "kw,expected",
    [
        ({"temperature": 0.7}, softmax64(V8 / 0.7)),
        # top_k 3 keeps ids 2, 5, 0; renormalized
        ({"top_k": 3}, softmax64(np.where(np.isin(np.arange(8), [0, 2, 5]), V8, -np.inf))),
    ],
)
def test_frequencies_match_over_seeds(kw, expected):
    draws = [S.sample(V8, state(seed=s, **kw)) for s in range(4000)]
    counts = np.bincount(draws, minlength=8)
    assert chi2(counts, expected) < 30  # df <= 7: 99.99% quantile ~ 29.9


def test_frequencies_match_over_steps_and_probs_agree():
    kw = dict(seed=77, temperature=1.3, top_p=0.9)
    draws = [S.sample(V8, state(output_token_ids=[0] * t, **kw)) for t in range(4000)]
    counts = np.bincount(draws, minlength=8)
    p = S.probs(V8, state(**kw))
    assert p.dtype == np.float32 and abs(p.sum() - 1) < 1e-6
    # By hand: softmax(V8 / 1.3) = .146 .099 .314 .031 .068 .214 .046 .082; in order 2 5 0 1 7 4
    # the cumulative mass is .314 .528 .674 .773 .855 .923: 0.9 is reached at id 4.
    keep = np.isin(np.arange(8), [2, 5, 0, 1, 7, 4])
    want = softmax64(np.where(keep, V8 / 1.3, -np.inf))
    np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-7)
    assert chi2(counts, want) < 30


def test_seeded_sampling_is_independent_of_the_batch():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(f32) * 3
    states = [state(seed=100 + i, stream=i % 2, temperature=0.8, top_p=0.95) for i in range(6)]
    alone = [S.sample(logits[i], states[i]) for i in range(6)]
    assert S.sample_batch(logits, states) == alone
    perm = [3, 0, 5, 1, 4, 2]
    assert S.sample_batch(logits[perm], [states[i] for i in perm]) == [alone[i] for i in perm]


def test_streams_steps_and_seeds_draw_differently():
    x = np.zeros(1000, dtype=f32)  # uniform: draws collide with probability 1/1000
    draws = {S.sample(x, state(seed=1, stream=c)) for c in range(20)}
    draws |= {S.sample(x, state(seed=1, output_token_ids=[0] * t)) for t in range(20)}
    draws |= {S.sample(x, state(seed=s)) for s in range(20)}
    assert len(draws) > 50


# --- logprobs -------------------------------------------------------------------------------------

LN2 = math.log(2)
# probs 1/8, 1/4, 1/8, 1/2
LP4 = np.array([0.0, LN2, 0.0, 2 * LN2], dtype=f32)


def test_logprobs_hand_derived():
    t = S.logprobs(LP4 + f32(7.0), 0, 3)
    assert t.token_id == 0 and t.rank == 3
    assert t.logprob == pytest.approx(math.log(1 / 8), rel=1e-6)
    assert [i for i, _ in t.top] == [3, 1, 0]  # 0 and 2 tie: lowest id first
    np.testing.assert_allclose([lp for _, lp in t.top], np.log([1 / 2, 1 / 4, 1 / 8]), rtol=1e-6)
    assert S.logprobs(LP4, 2, 0).rank == 3 and S.logprobs(LP4, 2, 0).top == []
    assert S.logprobs(LP4, 3, 1).rank == 1
    assert [i for i, _ in S.logprobs(LP4, 1, 20).top] == [3, 1, 0, 2]
    assert isinstance(t.logprob, float) and isinstance(t.top[0][0], int)


def test_logprobs_are_stable_and_ties_rank_alike():
    t = S.logprobs(np.array([1e4, 1e4, -1e4], dtype=f32), 1, 2)
    assert t.logprob == pytest.approx(-LN2, rel=1e-6) and t.rank == 1
    assert t.top[0][0] == 0 and t.top[1][0] == 1
    assert S.logprobs(np.array([1.0, 5.0, 5.0, 2.0, 5.0], dtype=f32), 4, 2).top[1][0] == 2


def test_logprobs_match_torch_log_softmax():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x = (rng.normal(size=(4, 500)) * 10).astype(f32)
    want = torch.log_softmax(torch.from_numpy(x).double(), -1).numpy()
    rows = S.logprobs_rows(x, [0, 10, 499, 7], 5)
    for r, (t, tok) in enumerate(zip(rows, [0, 10, 499, 7])):
        assert t.logprob == pytest.approx(want[r, tok], abs=2e-5)
        assert t.rank == 1 + int((want[r] > want[r, tok]).sum())
        top = np.argsort(-want[r], kind="stable")[:5]
        assert [i for i, _ in t.top] == top.tolist()
        np.testing.assert_allclose([lp for _, lp in t.top], want[r, top], atol=2e-5)


def test_logprobs_rows_hand_derived():
    rows = S.logprobs_rows(np.array([[0.0, 0.0], [math.log(3), 0.0]], dtype=f32), [1, 0], 1)
    assert rows[0].logprob == pytest.approx(-LN2, rel=1e-6) and rows[0].rank == 1
    assert rows[1].logprob == pytest.approx(math.log(3 / 4), rel=1e-5)
    assert rows[1].top == [(0, rows[1].logprob)]
    with pytest.raises(ValueError, match="token_ids"):
        S.logprobs_rows(np.zeros((2, 3), dtype=f32), [0], 0)
    with pytest.raises(ValueError, match="token_id"):
        S.logprobs(np.zeros(3, dtype=f32), 3, 0)
