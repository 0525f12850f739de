"""The one model config: Hugging Face `config.json` field names, frozen, shared by every backend."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kipp_core.rope import normalize, rope_type

SUPPORTED_ARCHITECTURE = "Qwen3ForCausalLM"
SUPPORTED_MODEL_TYPE = "qwen3"
# The integer fields that fix a checkpoint's shape.
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = 151643
    eos_token_id: int | tuple[int, ...] = 151645
    attention_bias: bool = False
    hidden_act: str = "silu"
    # None (the default RoPE) or a normalized YaRN dict (kipp_core.rope.normalize); not hashed
    rope_scaling: dict | None = field(default=None, hash=False)
    sliding_window: int | None = None
    use_sliding_window: bool = False
    max_window_layers: int | None = None
    architectures: tuple[str, ...] = (SUPPORTED_ARCHITECTURE,)
    model_type: str = SUPPORTED_MODEL_TYPE
    # {"scheme": "q8_0"|"affine4", "group_size": 32, ...} in checkpoints from `kipp quantize`.
    quantization: dict | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return tuple(e) if isinstance(e, (tuple, list)) else (e,)

    def num_params(self) -> int:
        h, i, n = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i
        per_layer += 2 * h + 2 * self.head_dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + head + n * per_layer + h

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        check_architecture(d)
        known = {f.name for f in fields(cls)} - {"extra"}
        kw: dict[str, Any] = {}
        for k, v in d.items():
            if k in known:
                kw[k] = v
        if "head_dim" not in kw or kw["head_dim"] is None:
            kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        # transformers 5 writes rope_parameters (rope_theta, rope_type and YaRN's keys together)
        # instead of rope_theta and rope_scaling; a rope_scaling given beside it wins, as there.
        rp = d.get("rope_parameters")
        if rp is not None and not isinstance(rp, dict):
            raise ValueError(f"config.json: rope_parameters must be an object, got {rp!r}")
        rp = rp or {}
        if "rope_theta" not in kw and "rope_theta" in rp:
            kw["rope_theta"] = rp["rope_theta"]
        where = "config.json: rope_scaling"
        if not kw.get("rope_scaling") and rope_type(rp) != "default":
            kw["rope_scaling"], where = rp, "config.json: rope_parameters"
        if "max_position_embeddings" in kw:
            kw["rope_scaling"], kw["max_position_embeddings"] = normalize(
                kw.get("rope_scaling"), kw["max_position_embeddings"], where
            )
        if "torch_dtype" not in kw and "dtype" in d:
            kw["torch_dtype"] = d["dtype"]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = tuple(kw["eos_token_id"])
        if isinstance(kw.get("architectures"), list):
            kw["architectures"] = tuple(kw["architectures"])
        if kw.get("quantization") is None and isinstance(d.get("quantization_config"), dict):
            kw["quantization"] = d["quantization_config"]
        missing = [f.name for f in fields(cls) if f.name not in kw and _required(f)]
        if missing:
            raise ValueError(f"config.json: missing required field(s) {', '.join(missing)}")
        kw["extra"] = {k: v for k, v in d.items() if k not in known}
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ModelConfig:
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"config.json not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"config.json is not valid JSON: {path}: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object: {path}")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d["architectures"] = list(self.architectures)
        if isinstance(self.eos_token_id, tuple):
            d["eos_token_id"] = list(self.eos_token_id)
        if d["quantization"] is None:
            d.pop("quantization")
        return d

    def validate(self) -> None:
        for name in SHAPE_FIELDS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({self.num_attention_heads}) must be a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.attention_bias:
            raise ValueError("config.json: attention_bias=true is not a Qwen3 dense checkpoint")
        if self.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act must be 'silu', got {self.hidden_act!r}")
        scaling, ctx = normalize(self.rope_scaling, 1, "config.json: rope_scaling")
        if scaling is not None and ctx != self.max_position_embeddings:
            raise ValueError(
                f"config.json: max_position_embeddings {self.max_position_embeddings} is not "
                f"what rope_scaling gives ({ctx}); build the config with with_rope_scaling"
            )

    @property
    def yarn(self) -> bool:
        return self.rope_scaling is not None

    def with_rope_scaling(self, scaling: dict | None) -> ModelConfig:
        """This config with its RoPE replaced: YaRN (`max_position_embeddings` becomes the
        context it gives) or None, the default RoPE over the original context."""
        base = self.max_position_embeddings
        if self.rope_scaling is not None:
            base = self.rope_scaling["original_max_position_embeddings"]
        rs, ctx = normalize(scaling, base, "rope_scaling")
        return replace(self, rope_scaling=rs, max_position_embeddings=ctx)


def _required(f) -> bool:
    from dataclasses import MISSING

    return f.default is MISSING and f.default_factory is MISSING


def check_architecture(d: dict[str, Any]) -> None:
    archs = d.get("architectures") or []
    model_type = d.get("model_type")
    if SUPPORTED_ARCHITECTURE not in archs or model_type != SUPPORTED_MODEL_TYPE:
        raise ValueError(
            f"unsupported architecture {archs!r} (model_type {model_type!r}): "
            f"Kipp runs {SUPPORTED_ARCHITECTURE} (model_type '{SUPPORTED_MODEL_TYPE}') only"
        )
