"""Static YaRN on every backend, past the original window: float32 logits equal the oracle's
(which equals transformers', tests/oracle/test_yarn.py) under the default-RoPE gate's 1e-5, and the
needle test: the same greedy tokens as the oracle for a 200-token prompt over a 64-position
original window (factor 4), prefilled in chunks that cross it."""

from __future__ import annotations

import numpy as np

from kipp_core.checkpoint import Checkpoint
from oracle.qwen3 import forward, load_weights
from tests.conformance.test_backend_gates import GREEDY, oracle_greedy
from tests.conftest import rel_err, yarn_config

CFG = yarn_config(vocab_size=512, rope_theta=10000.0)
PROMPT = np.random.default_rng(17).integers(0, 512, size=200).tolist()


def test_yarn_logits_match_oracle(make_llm, make_checkpoint):
    path = make_checkpoint(CFG, seed=23)
    llm = make_llm(path, max_num_batched_tokens=48)
    assert llm.config.yarn and llm.engine.max_model_len == 256
    ref = forward(load_weights(Checkpoint(path)), PROMPT)
    assert rel_err(llm.logits(PROMPT), ref) <= 1e-5


def test_needle_greedy_tokens_past_the_original_window(make_llm, make_checkpoint):
    path = make_checkpoint(CFG, seed=29)
    out = make_llm(path, block_size=16, max_num_batched_tokens=48).generate([PROMPT], GREEDY)[0]
    assert out.token_ids == oracle_greedy(path, PROMPT, GREEDY.max_tokens)


def test_startup_logs_kv_per_token_and_longest_context(make_llm, make_checkpoint, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="kipp"):
        make_llm(make_checkpoint(CFG, seed=23), num_kv_blocks=64, block_size=16)
    # float32 K and V: 2 layers x 2 kv heads x 32 dims x 2 x 4 bytes = 1 KiB a token
    want = (
        "KV cache: 1.00 KiB a token; 64 blocks of 16 = 1,024 tokens in 1.00 MiB; the longest "
        "context that fits: 256 tokens (the model allows 256, max_model_len is 256)"
    )
    assert want in caplog.text
