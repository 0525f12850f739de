"""The default KV budget at long context: the modest default (30% of free memory, at most 16 GiB
on a GPU) grows to one full-context request where 90% of free memory holds it, so that an 8B
context of 131,072 tokens (18 GiB of bf16 KV: 36 layers x 8 kv heads x 128 x 2 x 2 bytes =
144 KiB a token) runs without a --kv-cache-memory."""

from __future__ import annotations

import pytest
import torch

from kipp_core.registry import lookup
from kipp_cuda import kv_cache

GiB = 2**30
CFG_8B = lookup("qwen3-8b").config
GPU = torch.device("cuda")


@pytest.fixture
def free(monkeypatch):
    def set_free(nbytes):
        monkeypatch.setattr(kv_cache, "free_memory", lambda device: nbytes)

    return set_free


def test_8b_at_131k_gets_one_full_context(free):
    assert kv_cache.bytes_per_block(CFG_8B, 32, torch.bfloat16, None) == 32 * 144 * 2**10
    free(120 * GiB)  # an H200 after the 8B's weights
    kv = kv_cache.num_blocks_for(None, CFG_8B, 32, torch.bfloat16, None, GPU)
    per = 32 * 144 * 2**10
    assert kv.num_blocks == 16 * GiB // per and kv.num_blocks * 32 < 131072  # the cap falls short
    kv = kv_cache.num_blocks_for(None, CFG_8B, 32, torch.bfloat16, None, GPU, min_tokens=131072)
    assert kv.num_blocks * 32 == 131072 and kv.nbytes == 18 * GiB
    assert "one context of 131,072 tokens" in kv.why


def test_no_growth_past_free_memory_or_an_explicit_budget(free):
    free(19 * GiB)  # 90% of it is 17.1 GiB: no room for 18
    kv = kv_cache.num_blocks_for(None, CFG_8B, 32, torch.bfloat16, None, GPU, min_tokens=131072)
    assert kv.num_blocks * 32 < 131072
    free(120 * GiB)
    kv = kv_cache.num_blocks_for("4GiB", CFG_8B, 32, torch.bfloat16, None, GPU, min_tokens=131072)
    assert kv.num_blocks == 4 * GiB // (32 * 144 * 2**10)
