import dataclasses
import math

import numpy as np
import pytest

from kipp_core import sampling as S
from kipp_core.sampling import SamplerState, SamplingParams

NEG_INF = -np.inf
f32 = np.float32


def state(**kw) -> SamplerState:
    """SamplerState fields (seed, stream, token ids, stop_token_ids) go to the state, the rest to
    SamplingParams."""
    fields = {f.name for f in dataclasses.fields(SamplerState)}
    st_kw = {k: kw.pop(k) for k in list(kw) if k in fields and k != "params"}
    st_kw.setdefault("seed", 0)
    return SamplerState(params=SamplingParams(**kw), **st_kw)


# --- SamplingParams -------------------------------------------------------------------------------


def test_defaults_and_normalization():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_strings == [] and p.stop_token_ids == []
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(logit_bias={"12": 5, 3: -1.5}).logit_bias == {12: 5.0, 3: -1.5}
    assert SamplingParams(temperature=1).temperature == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(seed=2**80 + 1).seed == 2**80 + 1
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(n=np.int64(3)).n == 3
    assert SamplingParams(logprobs=0, prompt_logprobs=20).logprobs == 0


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().is_greedy


def test_replace_revalidates_and_params_are_frozen():
    p = SamplingParams(temperature=0.5)
    assert p.replace(top_p=0.5).top_p == 0.5 and p.top_p == 1.0
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=1.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0


def test_error_message_format():
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=-1.0)
    assert str(e.value) == "temperature must be >= 0, got -1.0"


BAD = [
    ("n", 0),
    ("n", 129),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("temperature", None),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", float("nan")),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_k", "5"),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", -3),
    ("frequency_penalty", 2.1),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", True),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 0.5),
    ("logprobs", 21),
    ("logprobs", -1),
    ("logprobs", 1.0),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", -1),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", 1),
    ("include_stop_str_in_output", None),
]


@pytest.mark.parametrize("name,value", BAD)
def test_invalid_scalar_values(name, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: value})
    assert name in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"logit_bias": {"abc": 1.0}}, "'abc'"),
        ({"logit_bias": {-1: 1.0}}, "-1"),
        ({"logit_bias": {"-1": 1.0}}, "'-1'"),
        ({"logit_bias": {"\uff11": 1.0}}, "'\uff11'"),  # a fullwidth digit
        ({"logit_bias": {5: 100.5}}, "100.5"),
        ({"logit_bias": {5: "x"}}, "'x'"),
        ({"logit_bias": [1, 2]}, "[1, 2]"),
        ({"stop": ""}, "''"),
        ({"stop": ["a", ""]}, "''"),
        ({"stop": ["a", 3]}, "3"),
        ({"stop": 5}, "5"),
        ({"stop": ["s"] * 17}, "['s'"),
        ({"stop_token_ids": [-1]}, "-1"),
        ({"stop_token_ids": ["3"]}, "'3'"),
        ({"stop_token_ids": [True]}, "True"),
        ({"stop_token_ids": 7}, "7"),
        ({"min_tokens": 5, "max_tokens": 4}, "5"),
    ],
)
def test_invalid_container_values(kw, fragment):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    name = next(iter(kw))
    assert name in str(e.value) and fragment in str(e.value)


def test_stop_token_set():
    p = SamplingParams(stop_token_ids=[7, 2])
    assert S.stop_token_set(p, (2, 9)) == (2, 9, 7)
    assert S.stop_token_set(p.replace(ignore_eos=True), (2, 9)) == (7, 2)


def test_resolve_seed():
    assert S.resolve_seed(SamplingParams(seed=5)) == 5
    a, b = S.resolve_seed(SamplingParams()), S.resolve_seed(SamplingParams())
    assert 0 <= a < 2**64 and a != b


# --- Noise ----------------------------------------------------------------------------------------

M = 0xFFFFFFFF


def py_fmix32(h):
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def py_uniform(seed, stream, step, n, salt=0):
    """The documented algorithm, in Python integers and float32 numpy scalars."""
    s = seed % 2**64
    words = [s % 2**32, s // 2**32, stream % 2**32, step % 2**32, salt % 2**32]
    keys = []
    for k in (0x243F6A88, 0xB7E15162):
        for w in words:
            k = py_fmix32(((k ^ w) * 0x9E3779B1 + 0x7F4A7C15) % 2**32)
        keys.append(k)
    out = []
    for i in range(n):
        h = py_fmix32(keys[0] ^ py_fmix32((i * 0x9E3779B9 + keys[1]) % 2**32))
        out.append((f32(h >> 9) + f32(0.5)) * f32(2.0**-23))
    return np.array(out, dtype=f32)


def test_fmix32_matches_murmur3_vectors():
    # MurmurHash3_x86_32 of the empty input with seed s is fmix32(s); published test vectors.
    h = S.fmix32(np.array([0, 1, 0xFFFFFFFF], dtype=np.uint32))
    assert h.tolist() == [0, 0x514E28B7, 0x81F16F39]


@pytest.mark.parametrize(
    "seed,stream,step,salt",
    [(0, 0, 0, 0), (1, 2, 3, 1), (2**64 - 1, 7, 10**6, 0), (-5, 0, 1, 2), (2**100 + 3, 1, 0, 0)],
)
def test_uniform_matches_independent_python(seed, stream, step, salt):
    got = S.uniform(seed, stream, step, 37, salt=salt)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, py_uniform(seed, stream, step, 37, salt))


def test_uniform_range_and_exactness():
    u = S.uniform(123, 0, 0, 1 << 16)
    assert u.min() > 0 and u.max() < 1
    k = u.astype(np.float64) * 2**23 - 0.5  # every value is (integer + 0.5) / 2**23
    np.testing.assert_array_equal(k, np.round(k))
    assert (k >= 0).all() and (k < 2**23).all()


def test_uniform_seed_is_reduced_to_64_bits_and_prefix_stable():
    np.testing.assert_array_equal(S.uniform(-1, 0, 0, 50), S.uniform(2**64 - 1, 0, 0, 50))
    np.testing.assert_array_equal(S.uniform(7, 1, 2, 50), S.uniform(7 + 2**64, 1, 2, 50))
    # Element i does not depend on n: padding the vocabulary changes nothing.
    np.testing.assert_array_equal(S.uniform(9, 0, 4, 10), S.uniform(9, 0, 4, 1000)[:10])


def chi2_uniform(u, bins=64) -> float:
    counts = np.bincount((u * bins).astype(np.int64), minlength=bins)
    expected = len(u) / bins
    return float(((counts - expected) ** 2 / expected).sum())


def check_uniform(u):
    n = len(u)
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 0.01
    assert chi2_uniform(u) < 120  # df 63: mean 63, 99.99% quantile ~ 110
    x = np.sort(u.astype(np.float64))
    ks = np.max(np.abs(np.arange(1, n + 1) / n - x))
    assert ks < 2.0 / math.sqrt(n)  # KS 99.9% critical value ~ 1.95 / sqrt(n)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 5 / math.sqrt(n)


def test_uniform_looks_uniform_along_each_axis():
    check_uniform(S.uniform(42, 0, 0, 1 << 16))  # along the vocabulary
    check_uniform(np.array([S.uniform(s, 0, 0, 1)[0] for s in range(4000)]))  # seeds
    check_uniform(np.array([S.uniform(3, 0, t, 2)[1] for t in range(4000)]))  # steps
    check_uniform(np.array([S.uniform(3, c, 5, 3)[2] for c in range(4000)]))  # streams


def test_uniform_differs_across_keys():
    base = S.uniform(1, 0, 0, 4096)
    for other in [
        S.uniform(2, 0, 0, 4096),
        S.uniform(1 + 2**32, 0, 0, 4096),
        S.uniform(1, 1, 0, 4096),
        S.uniform(1, 0, 1, 4096),
        S.uniform(1, 0, 0, 4096, salt=1),
    ]:
        assert np.mean(base == other) < 0.01
        assert abs(np.corrcoef(base, other)[0, 1]) < 0.1
    assert len(np.unique(base)) > 4000  # indices differ too


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


# --- an independent torch implementation: the model for the device samplers -----------------------


def torch_sampler():
    torch = pytest.importorskip("torch")
    T_M = 0xFFFFFFFF

    def mul32(a, c):  # a * c mod 2**32 without int64 overflow (torch has no uint32 multiply)
        return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & T_M

    def fmix(h):
        h = h ^ (h >> 16)
        h = mul32(h, 0x85EBCA6B)
        h = h ^ (h >> 13)
        h = mul32(h, 0xC2B2AE35)
        return h ^ (h >> 16)

    def t_uniform(seed, stream, step, n, salt):
        k1, k2 = S.noise_keys(seed, stream, step, salt)  # host side; checked against py_uniform
        i = torch.arange(n, dtype=torch.int64)
        h = fmix(k1 ^ fmix((mul32(i, 0x9E3779B9) + k2) & T_M))
        return ((h >> 9).to(torch.float32) + 0.5) * 2.0**-23

    def one(v):  # scalars as float32 tensors, as a batched kernel would have them
        return torch.tensor(v, dtype=torch.float32)

    def ids(seq, n):
        t = torch.tensor(list(seq), dtype=torch.int64)
        return t[(t >= 0) & (t < n)]

    def process(x, st):
        p, n = st.params, x.numel()
        x = x.clone()
        for tid, b in (p.logit_bias or {}).items():
            if tid < n:
                x[tid] += one(b)
        if len(st.output_token_ids) < p.min_tokens:
            x[ids(st.stop_token_ids, n)] = -torch.inf
        seen = torch.zeros(n, dtype=torch.bool)
        seen[ids(st.prompt_token_ids, n)] = True
        seen[ids(st.output_token_ids, n)] = True
        rp = one(p.repetition_penalty)
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        counts = torch.bincount(ids(st.output_token_ids, n), minlength=n).to(torch.float32)
        x = x - one(p.frequency_penalty) * counts
        return x - one(p.presence_penalty) * (counts > 0).to(torch.float32)

    def filt(x, p):
        x = x / one(p.temperature)
        if p.min_p > 0:
            x = torch.where(torch.exp(x - x.max()) >= one(p.min_p), x, -torch.inf)
        if 0 < p.top_k < x.numel():
            x = torch.where(x >= torch.topk(x, p.top_k).values[-1], x, -torch.inf)
        if p.top_p < 1:
            s, order = torch.sort(x, descending=True, stable=True)
            e = torch.exp(s - s[0])
            c = torch.cumsum(e, 0)
            before = torch.cat([torch.zeros(1), c[:-1]])
            n_keep = int((before < one(p.top_p) * c[-1]).sum())
            x = torch.where(x >= x[order[n_keep - 1]], x, -torch.inf)
        return x

    def sample(logits, st):
        x = process(torch.from_numpy(np.asarray(logits, dtype=f32)), st)
        if st.params.is_greedy:
            return int(torch.argmax(x))
        u = t_uniform(st.seed, st.stream, len(st.output_token_ids), x.numel(), 0)
        return int(torch.argmax(filt(x, st.params) - torch.log(-torch.log(u))))

    return torch, t_uniform, sample


def random_case(rng):
    v = int(rng.integers(8, 300))
    logits = (rng.normal(size=v) * rng.uniform(0.5, 8)).astype(f32)
    maybe = lambda p, val: val if rng.random() < p else None  # noqa: E731
    kw = dict(
        temperature=float(rng.choice([0.0, rng.uniform(0.05, 2.5)], p=[0.15, 0.85])),
        top_p=maybe(0.5, float(rng.uniform(0.05, 1.0))),
        top_k=maybe(0.5, int(rng.integers(-1, v + 5))),
        min_p=maybe(0.4, float(rng.uniform(0, 0.6))),
        repetition_penalty=maybe(0.4, float(rng.uniform(0.5, 2.0))),
        presence_penalty=maybe(0.4, float(rng.uniform(-2, 2))),
        frequency_penalty=maybe(0.4, float(rng.uniform(-2, 2))),
        logit_bias=maybe(
            0.3, {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, v + 10, size=4)}
        ),
        min_tokens=int(rng.integers(0, 4)),
        stop_token_ids=[int(t) for t in rng.integers(0, v, size=2)],
    )
    kw = {k: val for k, val in kw.items() if val is not None}
    params = SamplingParams(**kw)
    st = SamplerState(
        params=params,
        seed=int(rng.integers(0, 2**63)) * [1, -1, 2**20][int(rng.integers(0, 3))],
        stream=int(rng.integers(0, 4)),
        prompt_token_ids=rng.integers(0, v + 5, size=int(rng.integers(0, 20))).tolist(),
        output_token_ids=rng.integers(0, v + 5, size=int(rng.integers(0, 8))).tolist(),
        stop_token_ids=S.stop_token_set(params, [int(rng.integers(0, v))]),
    )
    return logits, st


def test_uniform_matches_torch_bit_for_bit():
    torch, t_uniform, _ = torch_sampler()
    for seed, stream, step, salt in [(0, 0, 0, 0), (2**64 - 1, 3, 17, 1), (-9, 1, 2**31, 0)]:
        got = S.uniform(seed, stream, step, 5000, salt)
        np.testing.assert_array_equal(got, t_uniform(seed, stream, step, 5000, salt).numpy())


def test_sample_matches_torch_implementation():
    _, _, t_sample = torch_sampler()
    rng = np.random.default_rng(1234)
    for _ in range(300):
        logits, st = random_case(rng)
        assert S.sample(logits, st) == t_sample(logits, st), st


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
