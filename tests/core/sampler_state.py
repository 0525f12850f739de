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
