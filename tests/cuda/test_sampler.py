"""The device sampler against kipp_core.sampling: the same token on every row (no tolerated
mismatches), the same filtered logits bit for bit, logprobs within 1e-5 with the same ranks and
top-N ids; plus the exact top-p kernel against numpy's sequential float32 cumsum. On CPU the Triton
kernels (noise, top-p) run under the interpreter; the gpu tests use Qwen3's vocabulary."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch

from kipp_core import sampling as S
from kipp_core.sampling import SamplerState, SamplingParams
from kipp_cuda import sampler as ds
from kipp_cuda.kernels import top_p as tp
from tests.core.sampler_state import extreme_state

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (Qwen3 vocabulary)")
f32 = np.float32


@pytest.fixture(autouse=True)
def kernels_on_cpu(monkeypatch):
    """Route the dispatched kernels to the interpreter on CPU (not to their references)."""
    monkeypatch.setenv("KIPP_CUDA_INTERPRET", "1")
    monkeypatch.setenv("KIPP_CUDA_REQUIRE_KERNELS", "1")
    monkeypatch.delenv("KIPP_CUDA_DISABLE_KERNELS", raising=False)


def state(logits_size: int, rng, **kw) -> SamplerState:
    v = logits_size
    return SamplerState(
        params=SamplingParams(**kw),
        seed=int(rng.integers(0, 2**63)) * [1, -1][int(rng.integers(0, 2))],
        stream=int(rng.integers(0, 4)),
        prompt_token_ids=rng.integers(0, v + 5, size=int(rng.integers(0, 30))).tolist(),
        output_token_ids=rng.integers(0, v + 5, size=int(rng.integers(0, 10))).tolist(),
        stop_token_ids=tuple(int(t) for t in rng.integers(0, v, size=2)),
    )


def random_params(rng, v: int) -> dict:
    maybe = lambda p, val: val if rng.random() < p else None  # noqa: E731
    kw = dict(
        temperature=float(rng.choice([0.0, rng.uniform(0.05, 2.5)], p=[0.2, 0.8])),
        top_p=maybe(0.5, float(rng.uniform(0.05, 1.0))),
        top_k=maybe(0.4, int(rng.integers(-1, v + 5))),
        min_p=maybe(0.4, float(rng.uniform(0, 0.6))),
        repetition_penalty=maybe(0.4, float(rng.uniform(0.5, 2.0))),
        presence_penalty=maybe(0.4, float(rng.uniform(-2, 2))),
        frequency_penalty=maybe(0.4, float(rng.uniform(-2, 2))),
        logit_bias=maybe(
            0.3, {int(t): float(rng.uniform(-100, 100)) for t in rng.integers(0, v + 10, size=4)}
        ),
        min_tokens=int(rng.integers(0, 4)),
        logprobs=maybe(0.3, int(rng.integers(0, 6))),
    )
    return {k: val for k, val in kw.items() if val is not None}


def random_logits(rng, B: int, v: int) -> np.ndarray:
    x = rng.normal(size=(B, v)) * rng.uniform(0.3, 8, size=(B, 1))
    if rng.random() < 0.3:
        x = np.round(x * 2) / 2  # many exact ties
    return x.astype(f32)


def check_batch(logits: np.ndarray, states: list[SamplerState]):
    """Tokens equal to kipp_core.sampling.sample on every row; logprobs where asked."""
    n_lp = [st.params.logprobs for st in states]
    toks, lps = ds.sample_rows(torch.from_numpy(logits).to(DEV), states, n_lp)
    want = [S.sample(row, st) for row, st in zip(logits, states)]
    assert toks == want
    for row, st, tok, lp in zip(logits, states, toks, lps or [None] * len(states)):
        if st.params.logprobs is None:
            assert lp is None
            continue
        check_logprob(lp, S.logprobs(row, tok, st.params.logprobs))


def check_logprob(got: S.TokenLogprob, want: S.TokenLogprob):
    assert got.token_id == want.token_id and got.rank == want.rank
    assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert [i for i, _ in got.top] == [i for i, _ in want.top]
    np.testing.assert_allclose([v for _, v in got.top], [v for _, v in want.top], atol=1e-5)
    assert all(isinstance(i, int) and isinstance(v, float) for i, v in got.top)


# -- the whole sampler --------------------------------------------------------------------------


def test_random_batches_match_the_reference_token_for_token():
    rng = np.random.default_rng(2024)
    for _ in range(24):
        v = int(rng.integers(8, 400))
        B = int(rng.integers(1, 7))
        check_batch(
            random_logits(rng, B, v), [state(v, rng, **random_params(rng, v)) for _ in range(B)]
        )


def test_larger_vocabularies_with_filters():
    # Flat rows put thousands of tokens inside the top-p sum, where a parallel cumsum's rounding
    # would move the boundary.
    rng = np.random.default_rng(7)
    for v, scale in ((2000, 0.3), (1000, 1.0), (1500, 4.0)):
        logits = (rng.normal(size=(3, v)) * scale).astype(f32)
        states = [
            state(v, rng, temperature=0.8, top_p=0.9),
            state(v, rng, temperature=1.3, top_p=0.5, top_k=v // 3, min_p=0.01),
            state(v, rng, temperature=0.5, top_p=0.97, repetition_penalty=1.2),
        ]
        check_batch(logits, states)


def test_filtered_logits_equal_the_reference_bit_for_bit():
    rng = np.random.default_rng(11)
    for _ in range(6):
        v = int(rng.integers(50, 1500))
        logits = random_logits(rng, 4, v)
        states = []
        for _ in range(4):
            kw = random_params(rng, v)
            kw["temperature"] = float(rng.uniform(0.1, 2.0))
            states.append(state(v, rng, **kw))
        x = ds.process_logits(torch.from_numpy(logits).to(DEV), states)
        f = ds.filtered_logits(x, [st.params for st in states]).cpu().numpy()
        for row, st, got in zip(logits, states, f):
            proc = S.process_logits(row, st)
            np.testing.assert_array_equal(x[states.index(st)].cpu().numpy(), proc)
            np.testing.assert_array_equal(got, S.filtered_logits(proc, st.params))


def test_greedy_batch_is_one_argmax_and_draws_no_noise(monkeypatch):
    rng = np.random.default_rng(3)
    logits = random_logits(rng, 5, 300)
    logits[2, [4, 9]] = logits[2].max() + 1  # a tie: the lowest id wins
    states = [state(300, rng, temperature=0.0) for _ in range(5)]
    for st in states:
        st.prompt_token_ids, st.output_token_ids = [], []
    monkeypatch.setattr(ds, "uniform_rows", None)  # any noise would fail
    toks, lps = ds.sample_rows(torch.from_numpy(logits).to(DEV), states)
    assert toks == np.argmax(logits, axis=-1).tolist() and toks[2] == 4 and lps is None


def test_a_graphs_argmax_serves_only_a_greedy_batch_that_needs_no_processing():
    """sample_tokens takes a precomputed argmax (a CUDA graph's) for plain greedy rows; a bias or
    a sampled row must not take it. The given argmax is deliberately wrong, so taking it shows."""
    rng = np.random.default_rng(4)
    logits = torch.from_numpy(random_logits(rng, 3, 300)).to(DEV)
    marker = torch.full((3,), 7, dtype=torch.int64, device=DEV)
    greedy = [state(300, rng, temperature=0.0) for _ in range(3)]
    for st in greedy:
        st.prompt_token_ids, st.output_token_ids = [], []
    toks, _ = ds.sample_tokens(logits, greedy, argmax=marker)
    assert toks.tolist() == [7, 7, 7]  # taken, not recomputed
    biased = [
        dataclasses.replace(st, params=SamplingParams(temperature=0.0, logit_bias={5: 100}))
        for st in greedy
    ]
    toks, _ = ds.sample_tokens(logits, biased, argmax=marker)
    assert toks.tolist() == [5, 5, 5]
    mixed = greedy[:2] + [state(300, rng, temperature=1.0)]
    mixed[2].prompt_token_ids, mixed[2].output_token_ids = [], []
    toks, _ = ds.sample_tokens(logits, mixed, argmax=marker)
    want = ds.sample_tokens(logits, mixed)[0].tolist()
    assert toks.tolist() == want and want[:2] == logits[:2].argmax(-1).tolist()


def test_temperature_only_batch_skips_the_filters(monkeypatch):
    rng = np.random.default_rng(4)
    logits = random_logits(rng, 3, 200)
    states = [state(200, rng, temperature=t) for t in (0.7, 1.0, 1.6)]
    monkeypatch.setattr(ds, "top_p_keep", None)
    monkeypatch.setattr(ds, "process_logits", None)
    for st in states:
        st.prompt_token_ids, st.output_token_ids = [], []
    toks, _ = ds.sample_rows(torch.from_numpy(logits).to(DEV), states)
    assert toks == [S.sample(row, st) for row, st in zip(logits, states)]


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    rng = np.random.default_rng(5)
    v = 300
    logits = random_logits(rng, 4, v)
    states = [state(v, rng, temperature=1.0, top_p=0.8) for _ in range(4)]
    alone = [
        ds.sample_rows(torch.from_numpy(logits[i : i + 1]).to(DEV), [st])[0][0]
        for i, st in enumerate(states)
    ]
    assert ds.sample_rows(torch.from_numpy(logits).to(DEV), states)[0] == alone
    # Each step draws fresh noise: the same logits at the next step usually sample differently.
    for st in states:
        st.output_token_ids = [*st.output_token_ids, 0]
    assert ds.sample_rows(torch.from_numpy(logits).to(DEV), states)[0] != alone


def test_everything_masked_or_infinite_rows():
    v = 64
    rng = np.random.default_rng(6)
    logits = random_logits(rng, 3, v)
    logits[1, 5] = np.inf
    st0 = state(v, rng, temperature=0.9, top_p=0.5, top_k=3, min_p=0.2)
    st0.params = st0.params.replace(logit_bias={i: -100.0 for i in range(v)})
    states = [
        st0,
        state(v, rng, temperature=0.9, top_p=0.5, min_p=0.1),
        state(v, rng, temperature=0.9, top_p=0.3),
    ]
    check_batch(logits, states)


def test_float32_edges_match_the_reference():
    """SamplingParams' float32 edges (overflowing penalties, top_p 0 in float32): no gather out
    of range, tokens equal to the reference."""
    rng = np.random.default_rng(7)
    for _ in range(6):  # 30 random extreme states (each batch ~4 s interpreted)
        states = [extreme_state(rng, 64) for _ in range(5)]
        check_batch(random_logits(rng, 5, 64) * 10, states)


def test_bad_arguments():
    with pytest.raises(ValueError, match="one row per state"):
        ds.sample_rows(torch.zeros(2, 5, device=DEV), [SamplerState(SamplingParams(), seed=0)])
    with pytest.raises(ValueError, match="num_logprobs"):
        ds.sample_rows(
            torch.zeros(1, 5, device=DEV), [SamplerState(SamplingParams(), seed=0)], [1, 2]
        )


# -- logprobs -----------------------------------------------------------------------------------

LN2 = math.log(2)
LP4 = np.array([0.0, LN2, 0.0, 2 * LN2], dtype=f32)  # probs 1/8, 1/4, 1/8, 1/2


def test_logprobs_hand_derived_and_tied():
    rows = np.stack([LP4 + f32(7.0), LP4, np.array([1.0, 5.0, 5.0, 2.0], f32)])
    got = ds.token_logprobs(torch.from_numpy(rows).to(DEV), [0, 2, 3], [3, 20, 1])
    for g, row, tok, n in zip(got, rows, [0, 2, 3], [3, 20, 1]):
        check_logprob(g, S.logprobs(row, tok, n))
    assert [i for i, _ in got[0].top] == [3, 1, 0]  # 0 and 2 tie: the lowest id first
    assert got[2].top[0][0] == 1  # 1 and 2 tie at the single slot


def test_prompt_logprobs_rows_match():
    rng = np.random.default_rng(8)
    x = (rng.normal(size=(6, 700)) * 6).astype(f32)
    x[3, :20] = x[3].max()  # a 20-way tie at the top
    targets = [0, 10, 699, 7, 3, 500]
    got = ds.token_logprobs(torch.from_numpy(x).to(DEV), targets, 5)
    for g, w in zip(got, S.logprobs_rows(x, targets, 5)):
        check_logprob(g, w)
    with pytest.raises(ValueError, match="token ids"):
        ds.token_logprobs(torch.from_numpy(x).to(DEV), [0, 1, 2, 3, 4, 700], 1)


# -- the exact top-p kernel ---------------------------------------------------------------------


def sorted_exp(x: np.ndarray) -> np.ndarray:
    s = np.sort(x)[::-1]
    return np.exp(s - s[0]).astype(f32)


def test_top_p_kernel_replays_the_sequential_float32_cumsum(monkeypatch):
    monkeypatch.setattr(tp, "BLOCK", 128)  # several blocks a row at small sizes
    rng = np.random.default_rng(9)
    rows, ps = [], []
    for L, scale, step in [
        (1, 1, 0),
        (2, 1, 0),
        (700, 0.05, 0),
        (900, 0.5, 0.125),
        (600, 3, 0),
        (800, 0.2, 0.5),
        (1000, 8, 0),
    ]:
        x = rng.normal(size=L) * scale
        if step:
            x = np.round(x / step) * step  # repeated values: rounding ties inside the sum
        rows.append(np.pad(sorted_exp(x.astype(f32)), (0, 1000 - L)))
        ps.append(f32(rng.uniform(0.05, 0.99)))
    e = torch.from_numpy(np.stack(rows)).to(DEV)
    p = torch.from_numpy(np.array(ps, f32)).to(DEV)
    n_keep, total = tp._top_p_keep_op(e, p, return_total=True)
    ref_keep, ref_total = tp.top_p_keep_ref(e, p, return_total=True)
    assert torch.equal(total.cpu(), ref_total.cpu())  # every float32 rounding replayed
    assert torch.equal(n_keep.cpu(), ref_keep.cpu())
    # A parallel (here float64) sum really does differ on such rows.
    assert any(np.float32(r.astype(np.float64).sum()) != t for r, t in zip(rows, ref_total))


# -- Qwen3's vocabulary on a GPU ----------------------------------------------------------------


@gpu
def test_gpu_sampler_over_the_vocabulary():
    rng = np.random.default_rng(10)
    V, B = 151936, 64
    for scale in (2.0, 12.0):
        logits = (rng.normal(size=(B, V)) * scale).astype(f32)
        states = [state(V, rng, **random_params(rng, V)) for _ in range(B)]
        check_batch(logits, states)
