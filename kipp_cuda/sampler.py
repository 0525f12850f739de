"""The batched device sampler: token for token the same as kipp_core.sampling.sample.

One call samples a batch of rows, each with its own SamplerState, in the reference's order: a
structured-outputs mask (SamplerState.allowed, one bool upload), logit bias, min_tokens masking,
repetition penalty, frequency then presence penalty; then greedy rows take the argmax and the
others divide by a float32 temperature, apply min_p, top_k and top_p, and take
argmax(filtered - log(-log(u))) with u the hash noise at (seed, stream, step, salt 0).

Every step is vectorized over the rows that need it, with neutral parameters for the others (x / 1,
x - 0 * counts leave float32 values unchanged, so this is exact). A batch where no row needs
processing or filtering costs one argmax (greedy) or a few elementwise kernels (temperature only).
top_p replays the reference's sequential float32 cumsum exactly (kernels/top_p.py) over the
candidates that can still change it, those within e^-17.5 of the maximum.

Known differences from numpy are in exp/log last-ulp results (torch's and numpy's libm differ):
they move a min_p boundary or a Gumbel argmax only on exact near-ties, which random inputs do not
produce; the tests check zero mismatches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kipp_core.sampling import SALT_SAMPLE, SamplerState, SamplingParams, TokenLogprob, noise_keys
from kipp_cuda.kernels.noise import uniform_rows
from kipp_cuda.kernels.top_p import top_p_keep
from kipp_cuda.staging import upload

_NEG_INF = float("-inf")
# exp(-17.5) < 2**-24 <= half an ulp of any running top-p sum (which starts at 1): tokens further
# below the maximum cannot change the sum, so they never need sorting.
_TOP_P_WINDOW = 17.5


def _needs_processing(st: SamplerState) -> bool:
    p = st.params
    return bool(
        st.allowed is not None
        or p.logit_bias
        or (st.step < p.min_tokens and st.stop_token_ids)
        or p.repetition_penalty != 1.0
        or p.frequency_penalty
        or p.presence_penalty
    )


def _filters(p: SamplingParams, vocab: int) -> bool:
    return p.min_p > 0 or 0 < p.top_k < vocab or p.top_p < 1


def _pairs(rows: list[int], ids: list[np.ndarray], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column index tensors for (row, id) pairs, built on the host, one upload each."""
    r = np.concatenate([np.full(len(i), row, np.int64) for row, i in zip(rows, ids)])
    c = np.concatenate(ids).astype(np.int64)
    return upload(r, device), upload(c, device)


def _ids_below(ids, vocab: int) -> np.ndarray:
    a = np.fromiter(ids, dtype=np.int64)
    return a[(a >= 0) & (a < vocab)]


def process_logits(x: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """kipp_core.sampling.process_logits for every row of x [B, V] float32 (a new tensor)."""
    B, V = x.shape
    dev = x.device
    x = x.clone()
    masked = [i for i, st in enumerate(states) if st.allowed is not None]
    if masked:
        keep = np.ones((B, V), dtype=bool)
        keep[masked] = np.stack([states[i].allowed for i in masked])
        x = x.masked_fill(~upload(keep, dev), _NEG_INF)
    bias_rows, bias_ids, bias_vals = [], [], []
    for i, st in enumerate(states):
        if st.params.logit_bias:
            ids = _ids_below(st.params.logit_bias, V)
            bias_rows.append(i)
            bias_ids.append(ids)
            bias_vals.append(np.array([st.params.logit_bias[int(t)] for t in ids], np.float32))
    if bias_rows:
        r, c = _pairs(bias_rows, bias_ids, dev)
        x.index_put_((r, c), upload(np.concatenate(bias_vals), dev), accumulate=True)
    stop_rows = [i for i, st in enumerate(states) if st.step < st.params.min_tokens]
    if stop_rows:
        ids = [_ids_below(states[i].stop_token_ids, V) for i in stop_rows]
        if sum(len(a) for a in ids):
            r, c = _pairs(stop_rows, ids, dev)
            x[r, c] = _NEG_INF
    rep_rows = [i for i, st in enumerate(states) if st.params.repetition_penalty != 1.0]
    if rep_rows:
        seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
        ids = [
            np.concatenate(
                [
                    _ids_below(states[i].prompt_token_ids, V),
                    _ids_below(states[i].output_token_ids, V),
                ]
            )
            for i in rep_rows
        ]
        if sum(len(a) for a in ids):
            r, c = _pairs(rep_rows, ids, dev)
            seen[r, c] = True
            rp = _column([st.params.repetition_penalty for st in states], dev)
            x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    pen_rows = [
        i
        for i, st in enumerate(states)
        if st.params.frequency_penalty or st.params.presence_penalty
    ]
    if pen_rows:
        counts = torch.zeros(B, V, dtype=torch.float32, device=dev)
        ids = [_ids_below(states[i].output_token_ids, V) for i in pen_rows]
        if sum(len(a) for a in ids):
            r, c = _pairs(pen_rows, ids, dev)
            counts.index_put_((r, c), torch.ones(len(r), device=dev), accumulate=True)
        # Two separate float32 subtractions, as the reference (and vLLM) does.
        x = x - _column([st.params.frequency_penalty for st in states], dev) * counts
        x = x - _column([st.params.presence_penalty for st in states], dev) * (counts > 0).float()
    return x


def _column(values, device) -> torch.Tensor:
    return upload(np.array(values, dtype=np.float32)[:, None], device)


def filtered_logits(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """kipp_core.sampling.filtered_logits for every row of processed logits x [S, V] (all rows
    random, temperature >= GREEDY_EPS)."""
    S, V = x.shape
    dev = x.device
    x = x / _column([p.temperature for p in params], dev)  # true division, as the reference
    if not any(_filters(p, V) for p in params):
        return x
    # A row whose maximum is not finite (all masked, or a +inf) is left unfiltered.
    x_max = x.max(dim=-1, keepdim=True).values
    finite = torch.isfinite(x_max)
    min_p = [p.min_p for p in params]
    if any(m > 0 for m in min_p):
        mp = _column(min_p, dev)
        skip = ~finite | (mp <= 0)
        x = torch.where(skip | (torch.exp(x - x_max) >= mp), x, _NEG_INF)
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if any(top_k):
        k = upload(np.array(top_k, dtype=np.int64), dev)[:, None]
        kth = torch.topk(x, max(top_k), dim=-1).values.gather(1, (k - 1).clamp(min=0))
        x = torch.where(~finite | (k == 0) | (x >= kth), x, _NEG_INF)  # ties with the k-th stay
    rows = [i for i, p in enumerate(params) if p.top_p < 1]
    if rows:
        x = _mask_top_p(x, rows, [params[i].top_p for i in rows], finite)
    return x


def _mask_top_p(
    x: torch.Tensor, rows: list[int], top_p: list[float], finite: torch.Tensor
) -> torch.Tensor:
    V = x.shape[1]
    dev = x.device
    idx = upload(np.array(rows, dtype=np.int64), dev)
    sub = x[idx] if len(rows) < x.shape[0] else x
    ok = finite[idx] if len(rows) < x.shape[0] else finite
    sub_max = sub.max(dim=-1, keepdim=True).values
    # Only the values within the window of the maximum can move the sequential sum.
    n_cand = max(1, int((sub >= sub_max - _TOP_P_WINDOW).sum(dim=-1).max()))
    if n_cand * 8 < V:
        s = torch.topk(sub, n_cand, dim=-1).values
    else:
        s = torch.sort(sub, dim=-1, descending=True).values
    e = torch.exp(s - s[:, :1])
    e = torch.where(ok, e, (torch.arange(s.shape[1], device=dev) == 0).float())  # inert rows
    p = torch.from_numpy(np.array(top_p, dtype=np.float32)).to(dev)
    n_keep = top_p_keep(e.contiguous(), p)
    # n_keep is in [1, L] by construction; the clamp makes an out-of-range gather impossible.
    boundary = s.gather(1, (n_keep - 1).clamp(0, s.shape[1] - 1)[:, None])
    masked = torch.where(~ok | (sub >= boundary), sub, _NEG_INF)  # ties with the last kept stay
    if len(rows) == x.shape[0]:
        return masked
    out = x.clone()
    out[idx] = masked
    return out


def gumbel_noise_rows(states: Sequence[SamplerState], vocab: int, device) -> torch.Tensor:
    """-log(-log(u)) [S, V] with u the reference's uniform noise at each row's (seed, stream,
    step, salt 0)."""
    keys = [noise_keys(st.seed, st.stream, st.step, SALT_SAMPLE) for st in states]
    k = upload(np.array(keys, dtype=np.int64).reshape(-1, 2), device)
    u = uniform_rows(k[:, 0].contiguous(), k[:, 1].contiguous(), vocab)
    return -torch.log(-torch.log(u))


def sample_rows(
    logits: torch.Tensor,
    states: Sequence[SamplerState],
    num_logprobs: Sequence[int | None] | None = None,
) -> tuple[list[int], list[TokenLogprob | None] | None]:
    """Sample one token per row of `logits` [B, V] (float32 on the device) with its state.

    Returns the token ids and, when `num_logprobs` has any non-None entry, one TokenLogprob per
    row (None where not asked): the sampled token's logprob under the raw logits, its rank and
    the top-N alternatives, as kipp_core.sampling.logprobs.
    """
    tokens, lps = sample_tokens(logits, states, num_logprobs)
    return tokens.tolist(), lps


def sample_tokens(
    logits: torch.Tensor,
    states: Sequence[SamplerState],
    num_logprobs: Sequence[int | None] | None = None,
    argmax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[TokenLogprob | None] | None]:
    """sample_rows with the tokens left on the device (int64 [B]): greedy and temperature-only
    batches without logprobs queue their kernels and return without waiting for them. `argmax`,
    when given, is logits.argmax(-1) already computed (in a CUDA graph): a greedy batch whose
    logits need no processing takes it instead of launching its own."""
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(
            f"logits must be [B, V] with one row per state, got "
            f"{tuple(logits.shape)} for {len(states)} states"
        )
    if num_logprobs is not None and len(num_logprobs) != len(states):
        raise ValueError(f"num_logprobs must have {len(states)} entries, got {len(num_logprobs)}")
    B, V = logits.shape
    raw = logits.float()
    if B == 0:
        return torch.zeros(0, dtype=torch.int64, device=raw.device), None
    dev = raw.device
    x = process_logits(raw, states) if any(_needs_processing(st) for st in states) else raw
    greedy = [st.params.is_greedy for st in states]
    if all(greedy):
        tokens = argmax if argmax is not None and x is raw else x.argmax(dim=-1)
    else:
        rand = [i for i, g in enumerate(greedy) if not g]
        # Row indices only for a mixed batch (an all-random one needs no upload).
        rand_t = None if len(rand) == B else upload(np.array(rand, dtype=np.int64), dev)
        sub = x if rand_t is None else x[rand_t]
        f = filtered_logits(sub, [states[i].params for i in rand])
        g = gumbel_noise_rows([states[i] for i in rand], V, dev)
        picked = (f + g).argmax(dim=-1)
        if rand_t is None:
            tokens = picked
        else:
            tokens = x.argmax(dim=-1)
            tokens[rand_t] = picked
    if num_logprobs is None or all(n is None for n in num_logprobs):
        return tokens, None
    rows = [i for i, n in enumerate(num_logprobs) if n is not None]
    lps = token_logprobs(
        raw[torch.tensor(rows, device=dev)],
        tokens[torch.tensor(rows, device=dev)],
        [num_logprobs[i] for i in rows],
    )
    out: list[TokenLogprob | None] = [None] * B
    for i, lp in zip(rows, lps):
        out[i] = lp
    return tokens, out


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """The reference's float32 log-softmax: x - max - log(sum(exp(x - max)))."""
    s = x - x.max(dim=-1, keepdim=True).values
    return s - torch.log(torch.exp(s).sum(dim=-1, keepdim=True))


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor | Sequence[int], top_n: int | Sequence[int]
) -> list[TokenLogprob]:
    """kipp_core.sampling.logprobs for each row of raw logits [R, V] and its token id: logprob,
    rank (1 + the number strictly higher) and the top-N by logprob, then lowest id."""
    R, V = logits.shape
    dev = logits.device
    if not isinstance(token_ids, torch.Tensor):  # sampled ids (a tensor) are valid already
        bad = [t for t in token_ids if not 0 <= int(t) < V]
        if bad or len(token_ids) != R:
            raise ValueError(f"token ids must be {R} values in [0, {V}), got {list(token_ids)}")
    tok = torch.as_tensor(token_ids, dtype=torch.int64, device=dev).reshape(R)
    ns = [int(top_n)] * R if isinstance(top_n, int) else [int(n) for n in top_n]
    if any(n < 0 for n in ns):
        raise ValueError(f"top_n must be >= 0, got {top_n!r}")
    lp = log_softmax(logits.float())
    mine = lp.gather(1, tok[:, None])
    rank = (lp > mine).sum(dim=-1) + 1
    n_max = min(max(ns, default=0), V)
    # One transfer each for the ints and the floats: [tok, rank, n_ge, ids] and [mine, vals, nth].
    ints, floats = [tok, rank], [mine[:, 0]]
    if n_max:
        vals, ids = torch.topk(lp, n_max, dim=-1)
        n = torch.tensor([max(1, min(v, V)) for v in ns], device=dev)
        nth = vals.gather(1, n[:, None] - 1)
        ints += [(lp >= nth).sum(dim=-1), ids.flatten()]
        floats += [vals.flatten(), nth[:, 0]]
    ih = torch.cat(ints).tolist()
    fh = torch.cat(floats).tolist()
    out = []
    for r in range(R):
        n = min(ns[r], V)
        top: list[tuple[int, float]] = []
        if n:
            if ih[2 * R + r] == n:  # no tie across the n-th value: topk's set is the answer
                ids_r = ih[3 * R + r * n_max : 3 * R + r * n_max + n]
                vals_r = fh[R + r * n_max : R + r * n_max + n]
                top = sorted(zip(ids_r, vals_r), key=lambda t: (-t[1], t[0]))
            else:  # ties at the n-th value: rank every candidate on the host
                cand = torch.nonzero(lp[r] >= fh[R + R * n_max + r]).flatten()
                top = sorted(zip(cand.tolist(), lp[r, cand].tolist()), key=lambda t: (-t[1], t[0]))[
                    :n
                ]
        out.append(TokenLogprob(ih[r], fh[r], ih[R + r], top))
    return out
