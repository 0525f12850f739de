"""The checkpoint registry: every Qwen3 dense checkpoint Kipp knows, with its exact shape.

Values are from `config.json` / `generation_config.json` of the Hub repos (see QWEN3.md sections 1
and 2; the 2507 refreshes: QWEN3-2507.md sections 1 and 2). A loaded config is checked field by
field against its entry. An entry with a `yarn` recipe may run past its native context with static
YaRN (Qwen's docs: 4B to 32B, factor 4 over 32,768 positions = 131,072).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kipp_core.config import SHAPE_FIELDS, ModelConfig

IM_END_ID = 151645
ENDOFTEXT_ID = 151643
THINK_END_ID = 151668


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float
    top_p: float
    top_k: int
    min_p: float = 0.0


# Qwen3 model cards: thinking mode (the generation_config.json default) and non-thinking mode.
THINKING_DEFAULTS = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
NON_THINKING_DEFAULTS = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20)


@dataclass(frozen=True)
class YarnRecipe:
    """The static YaRN a checkpoint's model card validates: `factor` over `original` positions."""

    factor: float
    original_max_position_embeddings: int

    @property
    def max_context(self) -> int:
        return int(self.factor * self.original_max_position_embeddings)

    def scaling(self, factor: float | None = None) -> dict:
        return {
            "rope_type": "yarn",
            "factor": float(factor or self.factor),
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


QWEN3_YARN = YarnRecipe(4.0, 32768)  # QWEN3.md "Context length / YaRN"


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    repo_id: str
    config: ModelConfig
    stop_token_ids: tuple[int, ...]
    sampling: SamplingDefaults = THINKING_DEFAULTS
    sampling_non_thinking: SamplingDefaults = NON_THINKING_DEFAULTS
    is_base: bool = False
    aliases: tuple[str, ...] = field(default=())
    yarn: YarnRecipe | None = None
    chat_template: str = "qwen3"  # kipp_core.chat_template.TEMPLATES: the one its repo ships

    @property
    def context_length(self) -> int:
        return self.config.max_position_embeddings

    @property
    def max_context_length(self) -> int:
        """The longest context it may run: with its YaRN recipe where it has one."""
        return self.yarn.max_context if self.yarn else self.context_length


# (hidden, intermediate, layers, heads, kv_heads, tied) per size, QWEN3.md section 1.
_SHAPES = {
    "0.6B": (1024, 3072, 28, 16, 8, True),
    "1.7B": (2048, 6144, 28, 16, 8, True),
    "4B": (2560, 9728, 36, 32, 8, True),
    "8B": (4096, 12288, 36, 32, 8, False),
    "14B": (5120, 17408, 40, 40, 8, False),
    "32B": (5120, 25600, 64, 64, 8, False),
}

# The fields that must equal the registry entry when a checkpoint is loaded.
CHECKED_FIELDS = (
    *SHAPE_FIELDS,
    "rope_theta",
    "rms_norm_eps",
    "tie_word_embeddings",
    "eos_token_id",
)


def _config(size: str, context: int, theta: float, eos: int) -> ModelConfig:
    h, i, n, nh, nkv, tied = _SHAPES[size]
    return ModelConfig(
        vocab_size=151936,
        hidden_size=h,
        intermediate_size=i,
        num_hidden_layers=n,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        head_dim=128,
        max_position_embeddings=context,
        rope_theta=theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        torch_dtype="bfloat16",
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=eos,
        max_window_layers=n,
    )


def _qwen3(size: str, base: bool) -> RegistryEntry:
    # Base checkpoints: 32768 context and <|endoftext|> as eos (QWEN3.md "Base models").
    cfg = _config(size, 32768 if base else 40960, 1_000_000.0, ENDOFTEXT_ID if base else IM_END_ID)
    suffix = "-Base" if base else ""
    repo = f"Qwen/Qwen3-{size}{suffix}"
    name = f"qwen3-{size.lower()}{suffix.lower()}"
    stops = (ENDOFTEXT_ID,) if base else (IM_END_ID, ENDOFTEXT_ID)
    return RegistryEntry(
        name=name,
        repo_id=repo,
        config=cfg,
        stop_token_ids=stops,
        is_base=base,
        aliases=(f"qwen3-{size}{suffix}", f"Qwen3-{size}{suffix}"),
        yarn=None if size in ("0.6B", "1.7B") else QWEN3_YARN,  # 32K-only sizes (tech report)
    )


def _qwen3_2507(kind: str) -> RegistryEntry:
    """Qwen3-4B-Instruct-2507 / -Thinking-2507: the 4B shape at rope_theta 5,000,000 and 262,144
    native positions (QWEN3-2507.md section 1.1, 2.1: the two config.json are byte-identical).
    Sampling: the model cards (Instruct's generation_config.json agrees; Thinking's is not
    published, its card's values are used). Neither has a second mode: Instruct never thinks,
    Thinking always does; no YaRN recipe is published for them."""
    cfg = _config("4B", 262144, 5_000_000.0, IM_END_ID)
    sampling = NON_THINKING_DEFAULTS if kind == "Instruct" else THINKING_DEFAULTS
    return RegistryEntry(
        name=f"qwen3-4b-{kind.lower()}-2507",
        repo_id=f"Qwen/Qwen3-4B-{kind}-2507",
        config=cfg,
        stop_token_ids=(IM_END_ID, ENDOFTEXT_ID),
        sampling=sampling,
        sampling_non_thinking=sampling,
        aliases=(f"Qwen3-4B-{kind}-2507",),
        chat_template=f"qwen3-{kind.lower()}-2507",
    )


# kipp-tiny: the embedded default, a real-vocabulary Qwen3 in a toy shape (q width 128 != hidden 64,
# GQA ratio 2, tied embeddings). Its weights come from a seed (kipp_core/tiny.py).
TINY = RegistryEntry(
    name="kipp-tiny",
    repo_id="kipp/kipp-tiny",
    config=ModelConfig(
        vocab_size=151936,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        max_window_layers=2,
    ),
    stop_token_ids=(IM_END_ID, ENDOFTEXT_ID),
)

REGISTRY: dict[str, RegistryEntry] = {TINY.name: TINY}
for _size in _SHAPES:
    for _base in (False, True):
        _e = _qwen3(_size, _base)
        REGISTRY[_e.name] = _e
for _kind in ("Instruct", "Thinking"):
    _e = _qwen3_2507(_kind)
    REGISTRY[_e.name] = _e


def lookup(name_or_repo: str) -> RegistryEntry | None:
    """Find an entry by registry name, alias or Hub repo id (case-insensitive)."""
    key = name_or_repo.strip().lower()
    for e in REGISTRY.values():
        if key in (e.name.lower(), e.repo_id.lower(), *(a.lower() for a in e.aliases)):
            return e
    return None


def check_config(cfg: ModelConfig, entry: RegistryEntry) -> None:
    """Raise ValueError naming the first field where `cfg` differs from the registry entry. Under
    YaRN the context is the one it gives (original x factor), not the entry's."""
    for name in CHECKED_FIELDS:
        if name == "max_position_embeddings" and cfg.yarn:
            continue
        got, want = getattr(cfg, name), getattr(entry.config, name)
        if name == "eos_token_id":
            ok = set(cfg.eos_token_ids) <= set(entry.stop_token_ids) | set(
                entry.config.eos_token_ids
            )
        elif isinstance(want, float):
            ok = abs(float(got) - want) <= 1e-9 * max(1.0, abs(want))
        else:
            ok = got == want
        if not ok:
            raise ValueError(
                f"config.json does not match registry entry {entry.name!r} ({entry.repo_id}): "
                f"{name} is {got!r}, expected {want!r}"
            )


def names() -> list[str]:
    return list(REGISTRY)
