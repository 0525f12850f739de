"""The context a run uses: `max_model_len` and a `rope_scaling` override (vLLM's `--rope-scaling`
/ `--hf-overrides`) applied to a checkpoint's config.

- `rope_scaling` (a dict or its JSON text) replaces the config's RoPE: YaRN gives original x
  factor positions; `{"rope_type": "default"}` turns a config's YaRN off.
- A `max_model_len` past the native context of a checkpoint whose registry entry has a YaRN recipe
  turns static YaRN on over the recipe's original window, with the factor that just covers the
  length (Qwen's docs: fit the factor to the context used, 2.0 for 65,536; at most the recipe's
  4.0, so 131,072 for Qwen3 4B-32B). Anything longer than the config allows is refused.
"""

from __future__ import annotations

import json
import logging

from kipp_core.config import ModelConfig
from kipp_core.registry import RegistryEntry

log = logging.getLogger("kipp")


def parse_rope_scaling(value) -> dict | None:
    """A dict (or None) from `--rope-scaling` JSON text or a dict; ValueError naming the field."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"rope_scaling is not valid JSON: {e}") from None
        if value is None or isinstance(value, dict):
            return value
    raise ValueError(f"rope_scaling must be a JSON object, got {value!r}")


def _describe(cfg: ModelConfig) -> str:
    rs = cfg.rope_scaling
    return (
        f"static YaRN, factor {rs['factor']:g} over {rs['original_max_position_embeddings']:,} "
        f"positions: a {cfg.max_position_embeddings:,}-token context"
    )


def long_context_config(
    cfg: ModelConfig,
    entry: RegistryEntry | None,
    max_model_len: int | None = None,
    rope_scaling=None,
) -> ModelConfig:
    """`cfg` with the RoPE and context that `max_model_len` and `rope_scaling` ask for."""
    name = entry.name if entry else "this checkpoint"
    scaling = parse_rope_scaling(rope_scaling)
    if rope_scaling is not None:
        cfg = cfg.with_rope_scaling(scaling)
        if cfg.yarn:
            log.info("rope_scaling override: %s", _describe(cfg))
            if entry is not None and entry.yarn is None:
                log.warning(
                    "%s has no published YaRN recipe; quality past its native %d "
                    "positions is untested",
                    name,
                    entry.context_length,
                )
    if max_model_len is None:
        return cfg
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {max_model_len!r}")
    ctx = cfg.max_position_embeddings
    if max_model_len <= ctx:
        return cfg
    if cfg.yarn or rope_scaling is not None:
        raise ValueError(
            f"max_model_len {max_model_len:,} exceeds the {ctx:,} positions of this "
            "rope_scaling; raise its YaRN factor"
        )
    recipe = entry.yarn if entry else None
    if recipe is None:
        raise ValueError(
            f"max_model_len {max_model_len:,} exceeds the {ctx:,}-token context of {name}, "
            "which has no YaRN recipe; pass rope_scaling (--rope-scaling) to extend it"
        )
    if max_model_len > recipe.max_context:
        raise ValueError(
            f"max_model_len {max_model_len:,} exceeds {recipe.max_context:,}, the longest "
            f"context of {name} (static YaRN, factor {recipe.factor:g} over "
            f"{recipe.original_max_position_embeddings:,} positions)"
        )
    factor = max_model_len / recipe.original_max_position_embeddings
    cfg = cfg.with_rope_scaling(recipe.scaling(factor))
    log.info(
        "max_model_len %d is past %s's native %d positions: %s (pass --rope-scaling to choose "
        "another factor)",
        max_model_len,
        name,
        ctx,
        _describe(cfg),
    )
    return cfg
