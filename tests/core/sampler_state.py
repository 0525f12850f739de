"""The sampling tests' shared builder of SamplerState from flat keyword arguments."""

from __future__ import annotations

import dataclasses

import numpy as np

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


# SamplingParams' float32 edges: the smallest and largest values it accepts, and top_p / min_p
# that are 0 in float32.
EDGES = dict(
    temperature=[0.0, 1e-5, 1.0, 1e30, 3.4e38],
    repetition_penalty=[2.0**-126, 1e-30, 1.0, 1e30, 3.4e38],
    top_p=[5e-324, 1e-45, 0.5, 1.0],
    min_p=[0.0, 1e-45, 1.0],
    presence_penalty=[-2.0, 0.0, 2.0],
    frequency_penalty=[-2.0, 2.0],
)


def extreme_state(rng: np.random.Generator, vocab: int) -> SamplerState:
    """A state with each sampling value drawn from EDGES, penalties over random history."""
    kw = {k: v[rng.integers(len(v))] for k, v in EDGES.items()}
    return state(
        seed=int(rng.integers(1000)),
        prompt_token_ids=rng.integers(0, vocab, 8).tolist(),
        output_token_ids=rng.integers(0, vocab, 8).tolist(),
        stop_token_ids=(1, 2),
        min_tokens=int(rng.integers(0, 17)),
        logit_bias={3: 100.0},
        **kw,
    )
