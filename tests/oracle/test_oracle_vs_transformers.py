"""The oracle gate: logits equal transformers' Qwen3ForCausalLM in float32 (relative error <= 1e-5)
and identical greedy tokens for 32 steps, on random-weight checkpoints of several shapes."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.checkpoint import Checkpoint
from oracle.qwen3 import KVCache, forward, load_weights
from tests.conftest import rel_err, small_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPES = {
    # tied, GQA 2, q width 128 != hidden 64
    "tied-gqa2": small_config(vocab_size=1024, num_hidden_layers=3),
    # untied, GQA 4, q width 128 != hidden 96
    "untied-gqa4": small_config(
        vocab_size=1024,
        hidden_size=96,
        intermediate_size=160,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        num_hidden_layers=3,
    ),
    # untied, GQA 5 (as 14B), q width 160 != hidden 80
    "untied-gqa5": small_config(
        vocab_size=1024,
        hidden_size=80,
        intermediate_size=144,
        num_attention_heads=10,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        num_hidden_layers=2,
    ),
    # tied with a stored lm_head.weight (as the 0.6B upload), GQA 8 (as 32B), rope theta 1e4
    "tied-stored-head-gqa8": small_config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=10000.0,
        num_hidden_layers=2,
    ),
}


def hf_model(path):
    m = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.eval()


@pytest.mark.parametrize("name", list(SHAPES))
def test_logits_match_transformers(name, make_checkpoint):
    kw = {"store_tied_lm_head": True} if "stored" in name else {}
    path = make_checkpoint(SHAPES[name], seed=11, **kw)
    w = load_weights(Checkpoint(path))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, SHAPES[name].vocab_size, size=45).tolist()
    ours = forward(w, ids)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == ref.shape == (45, SHAPES[name].vocab_size)
    assert rel_err(ours, ref) <= 1e-5
    assert np.max(np.abs(ours - ref)) <= 1e-5 * np.max(np.abs(ref)) * 10


@pytest.mark.parametrize("name", ["tied-gqa2", "untied-gqa5"])
def test_greedy_tokens_match_transformers_for_32_steps(name, make_checkpoint):
    path = make_checkpoint(SHAPES[name], seed=11)
    w = load_weights(Checkpoint(path))
    prompt = [5, 17, 300, 42, 99, 7, 512, 3]
    cache = KVCache(w.config.num_hidden_layers)
    logits = forward(w, prompt, 0, cache)
    ours = []
    for _ in range(32):
        t = int(np.argmax(logits[-1]))
        ours.append(t)
        logits = forward(w, [t], cache.length, cache)
    with torch.no_grad():
        out = hf_model(path).generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert ours == out[0, len(prompt) :].tolist()


def test_kv_cache_decode_equals_full_forward(make_checkpoint):
    path = make_checkpoint(SHAPES["untied-gqa4"], seed=3)
    w = load_weights(Checkpoint(path))
    ids = list(range(3, 40))
    full = forward(w, ids)
    cache = KVCache(w.config.num_hidden_layers)
    parts = [forward(w, ids[:20], 0, cache)] + [
        forward(w, [t], 20 + i, cache) for i, t in enumerate(ids[20:])
    ]
    assert rel_err(np.concatenate(parts), full) <= 1e-6


def test_float64_mode_matches_float32(make_checkpoint):
    path = make_checkpoint(SHAPES["tied-gqa2"], seed=5)
    ck = Checkpoint(path)
    ids = [1, 2, 3, 4, 5, 6, 7]
    l32 = forward(load_weights(ck, np.float32), ids)
    l64 = forward(load_weights(ck, np.float64), ids)
    assert l64.dtype == np.float64
    assert rel_err(l32, l64) <= 1e-5


def test_kipp_tiny_matches_transformers(tiny_path):
    w = load_weights(Checkpoint(tiny_path))
    ids = [9707, 1879, 11, 1246, 525, 498, 30, 151644, 872, 198]
    ours = forward(w, ids)
    with torch.no_grad():
        ref = hf_model(tiny_path)(torch.tensor([ids])).logits[0].numpy()
    assert rel_err(ours, ref) <= 1e-5
