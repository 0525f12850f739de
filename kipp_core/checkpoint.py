"""A Qwen3 checkpoint in Hugging Face layout: config, generation config and tensors by HF name.

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints are
memory-mapped; nothing is read until a tensor is asked for.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kipp_core.config import ModelConfig
from kipp_core.registry import RegistryEntry, check_config, lookup
from kipp_core.safetensors_file import RawTensor, SafetensorsFile

log = logging.getLogger("kipp")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LAYER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_norm",
    "self_attn.k_norm",
)


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a dense Qwen3 checkpoint holds, with its HF shape ([out, in] for linears)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    lin = {
        "self_attn.q_proj": (cfg.q_size, h),
        "self_attn.k_proj": (cfg.kv_size, h),
        "self_attn.v_proj": (cfg.kv_size, h),
        "self_attn.o_proj": (h, cfg.q_size),
        "mlp.gate_proj": (cfg.intermediate_size, h),
        "mlp.up_proj": (cfg.intermediate_size, h),
        "mlp.down_proj": (h, cfg.intermediate_size),
    }
    norms = {
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "self_attn.q_norm": (hd,),
        "self_attn.k_norm": (hd,),
    }
    for i in range(cfg.num_hidden_layers):
        p = layer_prefix(i)
        for k, s in lin.items():
            out[f"{p}{k}.weight"] = s
        for k, s in norms.items():
            out[f"{p}{k}.weight"] = s
    return out


class Checkpoint:
    """A checkpoint directory; `entry` (if known) is the registry entry its config must match."""

    def __init__(self, path: str | Path, entry: RegistryEntry | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"model directory not found: {self.path}")
        self.config = ModelConfig.from_file(self.path / "config.json")
        if entry is None:
            entry = _entry_for(self.path, self.config)
        if entry is not None:
            check_config(self.config, entry)
        else:
            log.info("checkpoint %s has a shape outside the registry; loading it as is", self.path)
        self.entry = entry
        self.generation_config = _read_json(self.path / "generation_config.json") or {}
        self._files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, str] = {}
        index = self.path / INDEX_FILE
        if index.exists():
            data = _read_json(index)
            if not isinstance(data, dict) or not isinstance(data.get("weight_map"), dict):
                raise ValueError(f"{index} is corrupt: no weight_map")
            self._where = dict(data["weight_map"])
            for fname in sorted(set(self._where.values())):
                self._files[fname] = SafetensorsFile(self.path / fname)
            for name, fname in self._where.items():
                if name not in self._files[fname]:
                    raise ValueError(
                        f"tensor {name!r} is listed in {INDEX_FILE} but missing "
                        f"from {self.path / fname}"
                    )
        elif (self.path / SINGLE_FILE).exists():
            f = SafetensorsFile(self.path / SINGLE_FILE)
            self._files[SINGLE_FILE] = f
            self._where = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise ValueError(f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path}")
        self._check_tensors()

    @property
    def quantization(self) -> dict | None:
        return self.config.quantization

    def _check_tensors(self) -> None:
        if self.quantization:
            return  # quantized layouts are checked by their loader (kipp_core.quant)
        for name, shape in expected_shapes(self.config).items():
            if name not in self._where:
                raise ValueError(f"checkpoint {self.path} is missing tensor {name!r}")
            got = self.raw(name).shape
            if tuple(got) != shape:
                raise ValueError(
                    f"checkpoint {self.path}: tensor {name!r} has shape {list(got)}, "
                    f"config.json implies {list(shape)}"
                )

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> Iterator[str]:
        return iter(self._where)

    def raw(self, name: str) -> RawTensor:
        if name not in self._where:
            raise ValueError(f"checkpoint {self.path} is missing tensor {name!r}")
        return self._files[self._where[name]].get(name)

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        return self.raw(name).to_numpy(dtype)

    def lm_head_name(self) -> str:
        """Tied checkpoints use the embedding, even when they also store a `lm_head.weight`."""
        return "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"

    def stop_token_ids(self) -> tuple[int, ...]:
        ids = list(self.entry.stop_token_ids) if self.entry else []
        gen = self.generation_config.get("eos_token_id")
        for x in ([gen] if isinstance(gen, int) else (gen or [])) + list(self.config.eos_token_ids):
            if isinstance(x, int) and x not in ids:
                ids.append(x)
        return tuple(ids)

    def nbytes(self) -> int:
        return sum(self.raw(n).data.nbytes for n in self._where)


def _read_json(path: Path):
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _entry_for(path: Path, cfg: ModelConfig) -> RegistryEntry | None:
    """The registry entry a local directory claims to be, by `_name_or_path` or its folder name."""
    for key in (cfg.extra.get("_name_or_path"), cfg.extra.get("kipp_registry_name"), path.name):
        if isinstance(key, str) and key:
            e = lookup(key) or lookup(key.rstrip("/").split("/")[-1])
            if e is not None:
                return e
    return None
