"""Shared fixtures. kipp-tiny and test checkpoints are built once per session from seeds."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

# Keep a user's real cache out of the suite unless KIPP_HOME is set explicitly.
os.environ.setdefault("KIPP_HOME", os.path.join(os.path.expanduser("~"), ".cache", "kipp-test"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from kipp_core.config import ModelConfig  # noqa: E402
from kipp_core.registry import TINY  # noqa: E402


@pytest.fixture(scope="session")
def tiny_path():
    from kipp_core.tiny import tiny_path

    return tiny_path()


def small_config(**kw) -> ModelConfig:
    """A toy Qwen3 shape; by default tied, GQA 2, q width (128) != hidden (64)."""
    return dataclasses.replace(TINY.config, **kw)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(cfg, seed=0, dtype='bfloat16', **kw) -> a checkpoint dir, cached by args."""
    from kipp_core.tiny import write_checkpoint

    cache = {}

    def make(cfg: ModelConfig, seed: int = 0, dtype: str = "bfloat16", **kw):
        key = (cfg, seed, dtype, tuple(sorted(kw.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp("ckpt")
            cache[key] = write_checkpoint(d, cfg, seed=seed, dtype=dtype, **kw)
        return cache[key]

    return make


def rel_err(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def nmse(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-30))
