"""What a front end needs to know of a model without its weights: the checkpoint and its config
(with any long-context override), the tokenizer, the chat template, the sampling defaults and
the limits. `LLM` builds one beside its engine; `kipp serve` builds one in the API process while
the engine process loads the weights (kipp_core.server.engine_process)."""

from __future__ import annotations

from kipp_core.chat_template import chat_template_for, read_template
from kipp_core.checkpoint import Checkpoint
from kipp_core.long_context import long_context_config
from kipp_core.resolve import DEFAULT_MODEL, resolve_model
from kipp_core.sampling import SamplingParams
from kipp_core.tokenizer import Tokenizer


class Frontend:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        max_model_len: int | None = None,
        rope_scaling: dict | str | None = None,
        max_waiting: int = 4096,
        speculative: bool = False,
    ):
        path, entry = resolve_model(model)
        self.checkpoint = Checkpoint(path, entry)
        # --max-model-len past the native context, or --rope-scaling: YaRN (kipp_core.long_context)
        self.checkpoint.config = long_context_config(
            self.checkpoint.config, self.checkpoint.entry, max_model_len, rope_scaling
        )
        self.config = self.checkpoint.config
        self.tokenizer = Tokenizer(path)
        self.chat_template = chat_template_for(
            read_template(path, self.tokenizer.config),
            entry.chat_template if (entry := self.checkpoint.entry) else "qwen3",
            self.tokenizer.config,
            str(path),
        )
        ctx = self.config.max_position_embeddings
        self.max_model_len = min(max_model_len or ctx, ctx)  # as LLMEngine computes it
        self.vocab_size = self.config.vocab_size
        self.max_waiting = max_waiting
        self.speculative = speculative  # speculative decoding is on: no token masks

    @property
    def registry_entry(self):
        return self.checkpoint.entry

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (temperature, top_p, top_k)."""
        g = self.checkpoint.generation_config
        kw = {}
        if g.get("do_sample", True) is False:
            kw["temperature"] = 0.0
        else:
            for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
                if isinstance(g.get(k), (int, float)) and not isinstance(g.get(k), bool):
                    kw[k] = g[k]
        kw.update(overrides)
        return SamplingParams(**kw)
