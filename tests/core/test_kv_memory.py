"""--kv-cache-memory as every backend reads it: a size needs its unit, a plain number is a
fraction of free memory in (0, 1]; the oracle sizes its block pool from it."""

from __future__ import annotations

import pytest

from kipp_core.kv_memory import parse_kv_memory


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("8GiB", ("bytes", 8 * 2**30)),
        ("512 MiB", ("bytes", 512 * 2**20)),
        ("2G", ("bytes", 2 * 2**30)),
        ("1.5GB", ("bytes", 1.5e9)),
        ("4096B", ("bytes", 4096)),
        (4096, ("bytes", 4096)),
        ("0.3", ("fraction", 0.3)),
        (1.0, ("fraction", 1.0)),
    ],
)
def test_sizes_and_fractions(value, want):
    assert parse_kv_memory(value) == want


@pytest.mark.parametrize("value", ["banana", "2.5", 2.5, "0", 0, -1, "-1GiB", "nan", True, "1 XB"])
def test_what_is_neither_is_refused(value):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_kv_memory(value)


def test_the_oracle_sizes_its_pool_from_a_budget(llm_factory):
    # kipp-tiny: 2 layers x (K, V) x 32 positions x 2 KV heads x 32 dims x 4 bytes = 32 KiB
    llm = llm_factory("oracle", kv_cache_memory="4MiB", max_model_len=512)
    assert llm.engine.backend.num_blocks == 4 * 2**20 // (2 * 2 * 32 * 2 * 32 * 4) == 128
    with pytest.raises(ValueError, match="less than one full-context request"):
        llm_factory("oracle", kv_cache_memory="1MiB")  # 32 blocks: 1,024 of 4,096 tokens
