"""The CUDA backend's KV pool: `kipp serve` sizes it with the serving rule (kipp_core.kv_budget)
and says so at start-up; `LLM` keeps the offline default; an explicit budget wins. kipp-tiny in
float32 holds 2 (K, V) x 2 layers x 2 kv heads x 32 dims x 4 bytes = 1,024 bytes a token, 32 KiB
a block of 32."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from kipp_core.checkpoint import Checkpoint

torch = pytest.importorskip("torch")
from kipp_cuda import kv_cache  # noqa: E402 (after the skip)

PER_BLOCK = 2 * 2 * 2 * 32 * 4 * 32


def _blocks(tiny_path, monkeypatch, free: int, budget=None, sizing="offline", seqs=4):
    from kipp_cuda import kv_cache

    monkeypatch.setattr(kv_cache, "free_memory", lambda device: free)
    cfg = Checkpoint(tiny_path).config
    cpu = torch.device("cpu")
    return kv_cache.num_blocks_for(budget, cfg, 32, torch.float32, None, cpu, 1, sizing, seqs, None)


def test_sizing_rules(tiny_path, monkeypatch):
    assert PER_BLOCK == 32 * 1024
    free = 10 * 2**30
    # serving: 4 streams x ceil(2,048 / 32) = 256 blocks (kipp-tiny's context is 4,096)
    kv = _blocks(tiny_path, monkeypatch, free, sizing="serving")
    assert kv.num_blocks == 256 and kv.nbytes == 256 * PER_BLOCK and "serving default" in kv.why
    # offline on a CPU device: min(0.3 x 10 GiB, 2 GiB, 4 contexts of 4,096) = 4 x 128 blocks
    kv = _blocks(tiny_path, monkeypatch, free)
    assert kv.num_blocks == 512 and "offline default" in kv.why
    # a larger model's 4 contexts pass 2 GiB: the 2 GiB cap (80 KiB a token at 40,960 tokens)
    cfg = Checkpoint(tiny_path).config
    big = dataclasses.replace(cfg, max_position_embeddings=40960, num_hidden_layers=40)
    kv = kv_cache.num_blocks_for(None, big, 32, torch.float32, None, torch.device("cpu"))
    assert kv.num_blocks == 2 * 2**30 // (20 * PER_BLOCK)
    # an explicit budget wins over either default
    kv = _blocks(tiny_path, monkeypatch, free, budget="1MiB", sizing="serving")
    assert kv.num_blocks == 32 and kv.why == "kv_cache_memory 1MiB"
    kv = _blocks(tiny_path, monkeypatch, free, budget=0.5)
    assert kv.num_blocks == 5 * 2**30 // PER_BLOCK and "0.5 of the 10.0 GiB free" in kv.why
    with pytest.raises(ValueError, match="kv_sizing"):
        _blocks(tiny_path, monkeypatch, free, sizing="huge")


def test_kipp_serve_loads_with_the_serving_rule(tiny_path, caplog):
    from kipp_core.cli import serve

    argv = ["--model", str(tiny_path), "--backend", "cuda", "--dtype", "float32"]
    args = serve.build_parser().parse_args([*argv, "--max-num-seqs", "4"])
    with caplog.at_level(logging.INFO, logger="kipp"):
        llm = serve._loader(args)()
    assert llm.backend.num_blocks == 256
    (line,) = [r.getMessage() for r in caplog.records if "KV budget" in r.getMessage()]
    assert "KV budget 0.01 GiB = 256 blocks of 32" in line and "max 8192 concurrent" in line
    assert "(serving default: room for 4 sequences of 2,048 tokens, within 90% of the" in line
