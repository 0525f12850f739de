"""`kipp serve`'s KV sizing rule on registry shapes and made-up free memory, against numbers
worked out by hand: a token's K and V take 2 x layers x kv_heads x head_dim x 2 bytes (bf16)."""

from __future__ import annotations

import pytest

from kipp_core.kv_budget import serving_budget
from kipp_core.registry import REGISTRY

GiB = 2**30
BS = 32  # tokens a block


def _per_block(name: str) -> int:
    c = REGISTRY[name].config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * BS


def test_shapes_per_block_by_hand():
    assert _per_block("qwen3-0.6b") == 2 * 28 * 8 * 128 * 2 * 32 == 3_670_016  # 112 KiB a token
    assert _per_block("qwen3-8b") == 2 * 36 * 8 * 128 * 2 * 32 == 4_718_592  # 144 KiB
    assert _per_block("qwen3-32b") == 2 * 64 * 8 * 128 * 2 * 32 == 8 * 2**20  # 256 KiB


def test_small_model_on_a_large_card_takes_what_its_streams_use():
    """0.6B, 256 streams, 40,960 context, 130 GiB free (an H200 after 1.2 GB of weights):
    256 x 2,048 / 32 = 16,384 blocks = 56 GiB, under 0.9 x 130 = 117 GiB."""
    b = serving_budget(130 * GiB, _per_block("qwen3-0.6b"), BS, 256, 40960)
    assert b.num_blocks == 16_384 and b.nbytes == 16_384 * 3_670_016 == 56 * GiB
    assert "room for 256 sequences of 2,048 tokens" in b.why and "90% of the 130.0 GiB" in b.why


def test_large_model_takes_the_fraction():
    """32B: 256 x 64 blocks would be 128 GiB; 70 GiB free gives floor(0.9 x 70 GiB / 8 MiB)."""
    b = serving_budget(70 * GiB, _per_block("qwen3-32b"), BS, 256, 40960)
    assert b.num_blocks == 63 * 128 == 8064  # 63 GiB / 8 MiB
    assert "90% of the 70.0 GiB free" in b.why and "would need 128.0 GiB" in b.why


def test_short_contexts_and_few_streams():
    per = _per_block("qwen3-8b")
    # --max-model-len 1024: each stream needs at most 32 blocks
    assert serving_budget(100 * GiB, per, BS, 256, 1024).num_blocks == 256 * 32
    # --max-num-seqs 4: 4 x 64 = 256 blocks, less than one 40,960-token context (1,280 blocks)
    b = serving_budget(100 * GiB, per, BS, 4, 40960)
    assert b.num_blocks == 1280 and "one context of 40,960 tokens" in b.why
    # blocks round up a stream: 3 x ceil(1,000 / 32) = 96, not ceil(3,000 / 32) = 94
    assert serving_budget(100 * GiB, per, BS, 3, 1000).num_blocks == 96
    # one 2,049-token context needs 65 blocks, a 2,048-token stream 64
    assert serving_budget(100 * GiB, per, BS, 1, 2049).num_blocks == 65


def test_small_card_is_capped():
    """8B on a 24 GB card, 6 GiB free: floor(0.9 x 6 GiB / 4,718,592) = 1,228 blocks."""
    b = serving_budget(6 * GiB, _per_block("qwen3-8b"), BS, 256, 40960)
    assert b.num_blocks == 1228 == int(0.9 * 6 * GiB) // 4_718_592


@pytest.mark.parametrize("field", ["free_bytes", "bytes_per_block", "max_num_seqs"])
def test_bad_values_name_the_field(field):
    kw = dict(free_bytes=GiB, bytes_per_block=1024, block_size=BS, max_num_seqs=8, max_model_len=64)
    kw[field] = 0
    with pytest.raises(ValueError, match=field):
        serving_budget(**kw)
