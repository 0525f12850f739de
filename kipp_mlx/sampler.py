"""Device sampling equal to kipp_core.sampling, batched over rows.

The same steps in the same order and in float32: a structured-outputs mask, logit bias,
min_tokens, repetition, frequency and presence penalties; greedy argmax; else temperature (a true
division), min_p, top_k, top_p (sequential float32 cumsum over the sorted values) and Gumbel-max
with the hash noise of kipp_core.noise.uniform, computed here in MLX uint32 ops. Ties go to the
lowest token id (mx.argmax returns the first maximum). Exp and log may differ from numpy's by an
ulp, so tokens are equal except where two candidates tie to within ~1e-7.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kipp_core.sampling import SALT_SAMPLE, SamplerState, noise_keys

F32 = mx.float32
NEG_INF = float("-inf")

# The constants of kipp_core.noise (its algorithm comment).
_C1, _C2 = 0x85EBCA6B, 0xC2B2AE35
_IDX_MUL = 0x9E3779B9


def _u32(c: int) -> mx.array:
    return mx.array(c, dtype=mx.uint32)


def fmix32(h: mx.array) -> mx.array:
    """MurmurHash3's finalizer on uint32 (MLX uint32 arithmetic wraps)."""
    h = h ^ (h >> _u32(16))
    h = h * _u32(_C1)
    h = h ^ (h >> _u32(13))
    h = h * _u32(_C2)
    return h ^ (h >> _u32(16))


def uniform(k1: mx.array, k2: mx.array, n: int) -> mx.array:
    """Row r: kipp_core.noise.uniform for the keys (k1[r], k2[r]); [R, n] float32 in (0, 1)."""
    i = mx.arange(n, dtype=mx.uint32)
    h = fmix32(k1[:, None] ^ fmix32(i * _u32(_IDX_MUL) + k2[:, None]))
    return ((h >> _u32(9)).astype(F32) + 0.5) * (2.0**-23)


def _ids_below(ids, v: int) -> np.ndarray:
    a = np.fromiter(ids, dtype=np.int64)
    return a[(a >= 0) & (a < v)]


def _dense(R: int, V: int, flat_idx: list[np.ndarray], value, dtype) -> mx.array:
    out = mx.zeros((R * V,), dtype=dtype)
    out[mx.array(np.concatenate(flat_idx).astype(np.int64))] = value
    return out.reshape(R, V)


def process_logits(logits: mx.array, states: Sequence[SamplerState]) -> mx.array:
    """kipp_core.sampling.process_logits for each row [R, V] with its state; float32."""
    x = logits.astype(F32)
    R, V = x.shape
    masked = [r for r, st in enumerate(states) if st.allowed is not None]
    if masked:
        keep = np.ones((R, V), dtype=bool)
        keep[masked] = np.stack([states[r].allowed for r in masked])
        x = mx.where(mx.array(keep), x, NEG_INF)
    idx, val = [], []
    for r, st in enumerate(states):
        if st.params.logit_bias:
            ids = _ids_below(st.params.logit_bias, V)
            idx.append(r * V + ids)
            val.append(np.array([st.params.logit_bias[int(i)] for i in ids], dtype=np.float32))
    if idx and sum(a.size for a in idx):
        flat = mx.array(np.concatenate(idx))
        x = x.reshape(-1).at[flat].add(mx.array(np.concatenate(val))).reshape(R, V)
    idx = [
        r * V + _ids_below(st.stop_token_ids, V)
        for r, st in enumerate(states)
        if st.step < st.params.min_tokens
    ]
    if idx and sum(a.size for a in idx):
        xf = x.reshape(-1)
        xf[mx.array(np.concatenate(idx))] = NEG_INF
        x = xf.reshape(R, V)
    rows = [r for r, st in enumerate(states) if st.params.repetition_penalty != 1.0]
    if rows:
        rp = np.ones((R, 1), dtype=np.float32)
        idx = []
        for r in rows:
            st = states[r]
            rp[r] = st.params.repetition_penalty
            seen = np.concatenate(
                [_ids_below(st.prompt_token_ids, V), _ids_below(st.output_token_ids, V)]
            )
            idx.append(r * V + np.unique(seen))
        if sum(a.size for a in idx):
            seen = _dense(R, V, idx, True, mx.bool_)
            rpa = mx.array(rp)
            x = mx.where(seen, mx.where(x > 0, x / rpa, x * rpa), x)
    rows = [
        r
        for r, st in enumerate(states)
        if st.params.frequency_penalty or st.params.presence_penalty
    ]
    if rows:
        fp, pp = np.zeros((R, 1), np.float32), np.zeros((R, 1), np.float32)
        idx, cnt = [], []
        for r in rows:
            st = states[r]
            fp[r], pp[r] = st.params.frequency_penalty, st.params.presence_penalty
            ids, n = np.unique(_ids_below(st.output_token_ids, V), return_counts=True)
            idx.append(r * V + ids)
            cnt.append(n.astype(np.float32))
        counts = mx.zeros((R * V,), dtype=F32)
        if sum(a.size for a in idx):
            counts[mx.array(np.concatenate(idx))] = mx.array(np.concatenate(cnt))
        counts = counts.reshape(R, V)
        # Two separate subtractions, as the reference (and vLLM) does.
        x = x - mx.array(fp) * counts
        x = x - mx.array(pp) * (counts > 0).astype(F32)
    return x


def _sorted_desc(g: mx.array, k: int) -> mx.array:
    """The k largest values of each row, in descending order (all of them when k == V)."""
    if k < g.shape[-1]:
        g = mx.topk(g, k, axis=-1)
    return -mx.sort(-g, axis=-1)


def filtered_logits(f: mx.array, params: Sequence, active: Sequence[bool]) -> mx.array:
    """kipp_core.sampling.filtered_logits after the temperature, on the `active` rows: min_p,
    top_k, top_p, each on what the previous left; rows with a non-finite max stay as they are."""
    R, V = f.shape
    min_p = [p.min_p if a else 0.0 for p, a in zip(params, active)]
    top_k = [p.top_k if a and 0 < p.top_k < V else 0 for p, a in zip(params, active)]
    top_p = [p.top_p if a and p.top_p < 1 else 1.0 for p, a in zip(params, active)]
    has_p = [t < 1 for t in top_p]
    if not any(min_p) and not any(top_k) and not any(has_p):
        return f
    fmax = mx.max(f, axis=-1, keepdims=True)
    g = f
    if any(min_p):
        # prob_i >= min_p * max_prob  <=>  exp(x_i - max) >= min_p (rows with 0 keep all)
        g = mx.where(mx.exp(f - fmax) >= mx.array(min_p, F32)[:, None], f, NEG_INF)
    thr = mx.full((R, 1), NEG_INF, dtype=F32)
    if any(top_k) or any(has_p):
        full = any(h and k == 0 for h, k in zip(has_p, top_k))
        K = V if full else max(top_k)
        s = _sorted_desc(g, K)
        if any(top_k):
            kk = mx.array([max(k, 1) - 1 for k in top_k], dtype=mx.int32)[:, None]
            on = mx.array([k > 0 for k in top_k])[:, None]
            thr = mx.where(on, mx.take_along_axis(s, kk, axis=-1), NEG_INF)  # ties stay
            if K < V and any(has_p):
                # top_p sums every survivor; past K only ties with the k-th value can survive.
                n_ge = mx.sum(g >= thr, axis=-1).tolist()
                if any(h and n > K for h, n in zip(has_p, n_ge)):
                    s = _sorted_desc(g, V)
        if any(has_p):
            s2 = mx.where(s >= thr, s, NEG_INF)
            # numpy's cumsum adds in sequence; so does MLX's on the CPU (a parallel scan on a GPU
            # may round differently, which matters only at an exact top_p boundary)
            c = mx.cumsum(mx.exp(s2 - s2[:, :1]), axis=-1)
            before = mx.concatenate([mx.zeros((R, 1), F32), c[:, :-1]], axis=-1)
            cut = mx.array(top_p, F32)[:, None] * c[:, -1:]
            n_keep = mx.sum(before < cut, axis=-1, keepdims=True).astype(mx.int32)
            # n_keep is 0 where top_p is 0 in float32: the top token stays, as in the reference
            boundary = mx.take_along_axis(s2, mx.maximum(n_keep, 1) - 1, axis=-1)
            thr = mx.maximum(thr, mx.where(mx.array(has_p)[:, None], boundary, NEG_INF))
    out = mx.where(g >= thr, g, NEG_INF)
    return mx.where(mx.isfinite(fmax), out, f)


def sample(logits: mx.array, states: Sequence[SamplerState]) -> mx.array:
    """One token per row [R] (int32, on the device), as kipp_core.sampling.sample."""
    x = process_logits(logits, states)
    greedy = [st.params.is_greedy for st in states]
    best = mx.argmax(x, axis=-1)
    if all(greedy):
        return best
    params = [st.params for st in states]
    temp = mx.array([1.0 if g else p.temperature for g, p in zip(greedy, params)], F32)[:, None]
    f = filtered_logits(x / temp, params, [not g for g in greedy])
    keys = np.array(
        [noise_keys(st.seed, st.stream, st.step, SALT_SAMPLE) for st in states], dtype=np.uint32
    )
    u = uniform(mx.array(keys[:, 0]), mx.array(keys[:, 1]), x.shape[-1])
    choice = mx.argmax(f + -mx.log(-mx.log(u)), axis=-1)
    return mx.where(mx.array(greedy), best, choice)
