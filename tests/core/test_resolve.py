"""--model resolution through a real Hugging Face cache layout (no network)."""

from __future__ import annotations

import shutil

import pytest

from kipp_core.resolve import resolve_model


def fake_hub_cache(root, repo_id, src):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<sha>/...}."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    shutil.copytree(src, repo / "snapshots" / sha)
    return repo / "snapshots" / sha


def test_local_directory(tiny_path):
    path, entry = resolve_model(str(tiny_path))
    assert path == tiny_path and entry is None


def test_kipp_tiny(tiny_path):
    path, entry = resolve_model("kipp-tiny")
    assert path == tiny_path and entry.name == "kipp-tiny"


def test_repo_id_from_hf_cache(tiny_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    snap = fake_hub_cache(tmp_path, "someone/qwen3-finetune", tiny_path)
    path, entry = resolve_model("someone/qwen3-finetune")
    assert path.resolve() == snap.resolve() and entry is None
    from kipp_core.llm import LLM

    assert LLM("someone/qwen3-finetune").config.hidden_size == 64


def test_registry_name_offline_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError) as e:
        resolve_model("qwen3-8b")
    msg = str(e.value)
    assert "Qwen/Qwen3-8B" in msg and "not in the Hugging Face cache" in msg


@pytest.mark.parametrize("bad", ["", "not a model", "./missing-dir", "/no/such/dir"])
def test_unknown_model_is_a_clear_error(bad):
    with pytest.raises(ValueError):
        resolve_model(bad)
