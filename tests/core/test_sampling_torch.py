"""The numpy sampler against an independent torch implementation of the same pipeline: the
model the device samplers follow."""

import numpy as np
import pytest

from kipp_core import sampling as S
from kipp_core.sampling import SamplerState, SamplingParams
from tests.core.sampler_state import f32

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
