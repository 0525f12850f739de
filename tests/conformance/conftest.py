"""Every backend runs the same gates. A backend whose package is missing is skipped, saying why."""

from __future__ import annotations

import importlib.util

import pytest

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
def make_llm(llm_factory, backend):
    """LLM factory on the parametrized backend, float32 unless asked otherwise."""

    def make(model=None, **kw):
        kw.setdefault("dtype", "float32")
        return llm_factory(backend, model, **kw)

    return make
