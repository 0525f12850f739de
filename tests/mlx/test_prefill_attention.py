"""Key-tiled prefill attention against MLX's SDPA (the reference) and a float64 numpy softmax
computed here: GQA and MHA, query rows fewer than keys (lower-right causal alignment), tiles that
split the masked edge, one row; and the switch to tiles past SDPA_SCORES, down to the model's
logits against the oracle."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kipp_core.checkpoint import Checkpoint
from oracle.qwen3 import forward, load_weights
from tests.conftest import rel_err, small_config
from tests.mlx.conftest import make_backend, random_ids

EPS32 = float(np.finfo(np.float32).eps)


def _inputs(hq, hkv, rows, keys, d=32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, hq, rows, d))
    k = rng.standard_normal((1, hkv, keys, d))
    v = rng.standard_normal((1, hkv, keys, d))
    return q, k, v


def _numpy_attention(q, k, v, scale):
    """float64, the mask and softmax written out: row i sees keys 0 .. N - L + i."""
    _, hq, L, _ = q.shape
    hkv, N = k.shape[1], k.shape[2]
    kk, vv = np.repeat(k[0], hq // hkv, axis=0), np.repeat(v[0], hq // hkv, axis=0)
    s = np.einsum("hld,hnd->hln", q[0], kk) * scale
    s[:, np.arange(N)[None, :] > (N - L + np.arange(L))[:, None]] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hln,hnd->hld", p / p.sum(axis=-1, keepdims=True), vv)[None]


def _bound(keys, v) -> float:
    """Both sides sum `keys` positive weights and `keys` weighted values in float32 in different
    orders (each at most keys * eps relative), from scores that differ by the rounding of a
    D-term dot product (a relative change of ~D eps |s| in each weight, under keys * eps here);
    the tile rescaling multiplies numerator and denominator by one factor, which cancels. So
    |o - o_ref| <= 4 keys eps max|v|, doubled for margin."""
    return 8 * keys * EPS32 * float(np.abs(v).max())


@pytest.mark.parametrize(
    "hq,hkv,rows,keys,tile",
    [
        (8, 2, 17, 40, 7),  # GQA, the causal edge inside a tile
        (8, 2, 17, 17, 1),  # a prefill from empty: one key a tile
        (3, 3, 5, 40, 64),  # MHA, one tile holds every key
        (4, 1, 1, 33, 8),  # one row (a verification or decode row)
        (4, 2, 12, 30, 6),  # tile edges on the causal edge (30 - 12 = 18 = 3 tiles)
    ],
)
def test_tiled_attention_equals_sdpa_and_numpy(hq, hkv, rows, keys, tile):
    from kipp_mlx.prefill_attention import tiled_attention

    q, k, v = _inputs(hq, hkv, rows, keys)
    scale = q.shape[-1] ** -0.5
    qm, km, vm = (mx.array(x.astype(np.float32)) for x in (q, k, v))
    got = np.array(tiled_attention(qm, km, vm, scale, tile))
    mask = "causal" if rows > 1 else None
    ref = np.array(mx.fast.scaled_dot_product_attention(qm, km, vm, scale=scale, mask=mask))
    assert np.abs(got - ref).max() <= _bound(keys, v)
    assert np.abs(got - _numpy_attention(q, k, v, scale)).max() <= _bound(keys, v)


def test_past_the_score_tile_the_keys_are_tiled(monkeypatch):
    from kipp_mlx import prefill_attention as pa

    calls = []
    tiled = pa.tiled_attention
    monkeypatch.setattr(pa, "tiled_attention", lambda *a: calls.append(a[-1]) or tiled(*a))
    q, k, v = (mx.array(x.astype(np.float32)) for x in _inputs(4, 2, 6, 20))
    whole = pa.prefill_attention(q, k, v, 0.2)
    assert calls == []  # 4 x 6 x 20 scores are few enough for SDPA
    monkeypatch.setattr(pa, "SDPA_SCORES", 4 * 6 * 20 - 1)
    monkeypatch.setattr(pa, "SCORE_TILE", 4 * 6 * 5)
    part = pa.prefill_attention(q, k, v, 0.2)
    assert calls == [5]
    assert np.abs(np.array(part) - np.array(whole)).max() <= _bound(20, np.array(v))


def test_a_long_prefill_in_key_tiles_matches_oracle(make_checkpoint, monkeypatch):
    """Chunks of 13 over a 45-token context, 3 keys a tile: every layer's attention tiled."""
    from kipp_mlx import prefill_attention as pa
    from tests.mlx.conftest import run_logits

    cfg = small_config(vocab_size=512, num_attention_heads=8, num_key_value_heads=2)
    monkeypatch.setattr(pa, "SDPA_SCORES", 0)
    monkeypatch.setattr(pa, "SCORE_TILE", cfg.num_attention_heads * 13 * 3)
    path = make_checkpoint(cfg, seed=3)
    ids = random_ids(45, 512, seed=1)
    got = run_logits(make_backend(path, block_size=4), ids, chunks=(13, 13, 13))
    assert rel_err(got, forward(load_weights(Checkpoint(path)), ids)) <= 1e-5
