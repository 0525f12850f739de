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


def spy_batches(llm, async_scheduling: bool) -> tuple[list[list[int]], object]:
    """(the seq ids of each batch the engine queues, the backend's execute_async): both empty or
    None unless async scheduling is on and the backend has it."""
    batches: list[list[int]] = []
    backend = llm.engine.backend
    run = getattr(backend, "execute_async", None) if async_scheduling else None
    if run is not None:
        backend.execute_async = lambda b: batches.append([s.seq_id for s in b.seqs]) or run(b)
    return batches, run
