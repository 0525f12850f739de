"""Shared fixtures. kipp-tiny and test checkpoints are built once per test run from seeds."""

from __future__ import annotations

import dataclasses
import math
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


@pytest.fixture
def llm_factory(tiny_path):
    """llm_factory(backend, model=None, **kw) -> LLM; after the test every KV block of every
    engine it made must be free again, and no request left unfinished."""
    from kipp_core.llm import LLM

    made = []

    def make(backend: str = "oracle", model=None, **kw):
        llm = LLM(str(model or tiny_path), backend=backend, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert not llm.engine.has_unfinished_requests()
        llm.engine.block_manager.check_all_free()


def small_config(**kw) -> ModelConfig:
    """A toy Qwen3 shape; by default tied, GQA 2, q width (128) != hidden (64)."""
    return dataclasses.replace(TINY.config, **kw)


# Static YaRN over an original window of 64 positions: 256 with factor 4 (the needle tests).
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def yarn_config(scaling: dict = YARN, **kw) -> ModelConfig:
    """small_config with a 64-position original window and YaRN `scaling` over it."""
    return small_config(max_position_embeddings=64, **kw).with_rope_scaling(scaling)


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


F32_U = 2.0**-24  # float32's unit roundoff


def f32_paths_atol(magnitude: float, terms: int) -> float:
    """How far two float32 computations of one value may differ when they add the same terms
    in other orders (another BLAS blocking, a padded graph, another backend): each is within
    the first-order bound terms * u * magnitude of the exact value, so the two within twice
    that. `terms`: the longest chain of additions behind the value (the widest matmul plus the
    attention span); `magnitude`: the largest of the values involved (a model's logits bound
    what its layers carry, as the final norm and head scale them)."""
    return 2 * terms * F32_U * magnitude


def logprob_atol(max_logit: float, terms: int, vocab: int) -> float:
    """f32_paths_atol for a logprob x_t - logsumexp(x): the two logits' errors, plus the
    tree-summed exponentials' rounding (ceil(log2 V) additions, relative to a sum >= 1) on
    each side."""
    return 2 * f32_paths_atol(max_logit, terms) + 2 * math.ceil(math.log2(vocab)) * F32_U


def rel_err(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def nmse(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.mean((a - b) ** 2) / max(np.mean(b**2), 1e-30))


def status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM: the peak) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)
