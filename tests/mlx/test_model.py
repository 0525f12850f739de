"""The MLX model against the numpy oracle and against mlx-lm (an independent MLX implementation):
prefill chunks on scattered blocks, batched decode with ragged contexts, both weight layouts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kipp_core.backend import ModelInput, SeqInput
from kipp_core.checkpoint import Checkpoint
from oracle.qwen3 import forward, load_weights
from tests.conftest import nmse, rel_err, small_config
from tests.mlx.conftest import make_backend, random_ids, run_logits

SHAPES = {
    "tied": small_config(vocab_size=512),
    "untied-gqa4": small_config(
        vocab_size=512, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "mha-odd": small_config(
        vocab_size=512,
        hidden_size=96,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=32,
        intermediate_size=160,
    ),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_chunked_prefill_on_scattered_blocks_matches_oracle(make_checkpoint, name):
    path = make_checkpoint(SHAPES[name], seed=3)
    be = make_backend(path, block_size=4)
    ids = random_ids(45, 512, seed=1)
    table = list(np.random.default_rng(2).permutation(40)[:12])  # 12 blocks, out of order
    got = run_logits(be, ids, table, chunks=(7, 13))
    ref = forward(load_weights(Checkpoint(path)), ids)
    assert rel_err(got, ref) <= 1e-5


def test_long_prefill_in_query_chunks_matches_oracle(make_checkpoint, monkeypatch):
    from kipp_mlx import attention

    monkeypatch.setattr(attention, "QUERY_CHUNK", 6)
    path = make_checkpoint(SHAPES["tied"], seed=3)
    ids = random_ids(45, 512, seed=1)
    got = run_logits(make_backend(path, block_size=4), ids, chunks=(7,))
    assert rel_err(got, forward(load_weights(Checkpoint(path)), ids)) <= 1e-5


@pytest.mark.parametrize("padded", [True, False])
def test_batched_decode_with_ragged_contexts_matches_oracle(make_checkpoint, monkeypatch, padded):
    """Two sequences of different lengths decode together: the padded, masked decode path, and
    the per-sequence path that large batches take."""
    from kipp_mlx import attention

    monkeypatch.setattr(attention, "MAX_PADDED_SLOTS", 1 << 16 if padded else 8)
    path = make_checkpoint(SHAPES["untied-gqa4"], seed=4)
    be = make_backend(path, block_size=4)
    w = load_weights(Checkpoint(path))
    seqs = [random_ids(9, 512, seed=5), random_ids(22, 512, seed=6)]
    tables = [[3, 7, 1, 9, 11, 12], [0, 2, 4, 5, 6, 8, 10, 13, 14]]
    for i, ids in enumerate(seqs):
        be.execute(ModelInput([SeqInput(i, ids, 0, tables[i])]))
    for step in range(4):
        nxt = [(step * 37 + 11 * i) % 512 for i in range(2)]
        batch = [
            SeqInput(i, [nxt[i]], len(seqs[i]), tables[i], return_logits=True) for i in range(2)
        ]
        outs = be.execute(ModelInput(batch))
        for i in range(2):
            seqs[i] = seqs[i] + [nxt[i]]
            ref = forward(w, seqs[i])[-1:]
            assert rel_err(outs[i].logits, ref) <= 1e-5


def test_hf_layout_matches_oracle(make_checkpoint):
    """The layout Metal runs ([out, in] weights, no swap), checked here on the CPU."""
    from kipp_mlx.loader import load_model

    path = make_checkpoint(SHAPES["untied-gqa4"], seed=7)
    be = make_backend(path, block_size=8)
    be.model = load_model(Checkpoint(path), mx.float32, cpu_layout=False)
    assert "weight" in be.model.model.layers[0].self_attn.qkv_proj
    ids = random_ids(30, 512, seed=8)
    assert rel_err(run_logits(be, ids), forward(load_weights(Checkpoint(path)), ids)) <= 1e-5


@pytest.mark.parametrize("parts", [1, 3])
def test_cpu_layout_is_bit_identical_to_plain_gemm(parts):
    """Transposed, split into column parts on separate streams and held in float32, a bf16
    weight gives exactly MLX's bf16 gemm result; the embedding lookup gives exactly its rows."""
    from kipp_mlx.layout import TransposedEmbedding, TransposedLinear

    rng = np.random.default_rng(0)
    w = mx.array(rng.standard_normal((96, 64)).astype(np.float32)).astype(mx.bfloat16)
    for rows in (1, 5, 33):
        x = mx.array(rng.standard_normal((rows, 64)).astype(np.float32)).astype(mx.bfloat16)
        want = x @ w.T
        for store in (mx.float32, None):
            got = TransposedLinear(w, store, parts)(x)
            assert got.dtype == mx.bfloat16
            assert mx.array_equal(got, want).item()
    emb = TransposedEmbedding(w, mx.float32, parts)
    ids = mx.array([5, 0, 95, 5, 31, 32, 64])
    assert mx.array_equal(emb(ids), w[ids]).item() and emb(ids).dtype == mx.bfloat16


def test_matches_mlx_lm(make_checkpoint):
    mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
    path = make_checkpoint(SHAPES["tied"], seed=9)
    peer, _ = mlx_lm_utils.load_model(path)
    peer.set_dtype(mx.float32)
    ids = random_ids(33, 512, seed=10)
    ref = np.array(peer(mx.array(ids)[None])[0])
    assert rel_err(run_logits(make_backend(path), ids), ref) <= 1e-5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_oracle(make_checkpoint, dtype):
    path = make_checkpoint(SHAPES["tied"], seed=11)
    ids = random_ids(40, 512, seed=12)
    got = run_logits(make_backend(path, dtype=dtype, block_size=16), ids, chunks=(17,))
    assert nmse(got, forward(load_weights(Checkpoint(path)), ids)) <= 1e-3
