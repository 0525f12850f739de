"""`--model` resolution: a local directory, `kipp-tiny`, a registry name, or a Hub repo id."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from kipp_core.registry import REGISTRY, RegistryEntry, lookup

log = logging.getLogger("kipp")

DEFAULT_MODEL = "kipp-tiny"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a checkpoint needs from a Hub repo (no .bin / .pth / original/ duplicates).
_ALLOW = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model(model: str | os.PathLike) -> tuple[Path, RegistryEntry | None]:
    """Return the checkpoint directory and the registry entry it must match (None if not listed)."""
    model, local, entry = _name(model)
    if local is not None:
        return local, entry
    return hub_snapshot(entry.repo_id if entry else model), entry


def check_model_name(model: str | os.PathLike) -> None:
    """resolve_model's ValueError for a name that names no model, without going to the Hub."""
    _name(model)


def _name(model):
    """(the name, its local directory or None, its registry entry or None), or ValueError."""
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if not isinstance(model, str) or not model.strip():
        raise ValueError("model must be a directory, a registry name or a Hugging Face repo id")
    if model == DEFAULT_MODEL or model == REGISTRY[DEFAULT_MODEL].repo_id:
        from kipp_core.tiny import tiny_path

        return model, tiny_path(), REGISTRY[DEFAULT_MODEL]
    p = Path(model).expanduser()
    if p.is_dir():
        return model, p, None
    entry = lookup(model)
    if entry is None and not _REPO_ID.match(model):
        if p.exists() or "/" in model or model.startswith("."):
            raise ValueError(f"model path {model!r} is not a directory")
        raise ValueError(
            f"unknown model {model!r}: not a directory, a registry name "
            f"({', '.join(REGISTRY)}), or a Hugging Face repo id"
        )
    return model, None, entry


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of `repo_id`: from the Hugging Face cache, else downloaded."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - a declared dependency
        raise ValueError("huggingface_hub is not installed; pass a local directory") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_ALLOW, local_files_only=True))
    except Exception:
        pass  # not cached (or only partly): try the Hub
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if offline:
        raise ValueError(
            f"model {repo_id} is not in the Hugging Face cache and HF_HUB_OFFLINE is set; "
            f"download it first (huggingface-cli download {repo_id}) or pass a local directory"
        )
    log.info("downloading %s from the Hugging Face Hub", repo_id)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_ALLOW, etag_timeout=10))
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"model {repo_id} is not in the Hugging Face cache and could not be downloaded "
            f"({type(e).__name__}: {reason}); check the network, or pass a local directory"
        ) from None
