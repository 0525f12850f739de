"""Every backend runs the same gates. A backend whose package is missing is skipped, saying why."""

from __future__ import annotations

import importlib.util

import pytest

from kipp_core.llm import LLM

BACKENDS = ["oracle", "cuda", "mlx"]
NEEDS = {"cuda": "torch", "mlx": "mlx"}


def _available(name: str) -> str | None:
    mod = NEEDS.get(name)
    if mod and importlib.util.find_spec(mod) is None:
        return f"{name} backend needs {mod}, which is not installed"
    pkg = {"cuda": "kipp_cuda.backend", "mlx": "kipp_mlx.backend"}.get(name)
    if pkg and importlib.util.find_spec(pkg) is None:
        return f"{pkg} does not exist yet"
    return None


@pytest.fixture(params=BACKENDS)
def backend(request):
    why = _available(request.param)
    if why:
        pytest.skip(why)
    return request.param


@pytest.fixture
def make_llm(tiny_path, backend):
    """LLM factory on the parametrized backend (float32); checks for leaked KV blocks after."""
    made = []

    def make(model=None, **kw):
        kw.setdefault("dtype", "float32")
        llm = LLM(str(model or tiny_path), backend=backend, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        assert not llm.engine.has_unfinished_requests()
        llm.engine.block_manager.check_all_free()
