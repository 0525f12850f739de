"""`LLM`: the offline Python API over the engine, shared by tests, the CLI and every backend."""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Sequence as SequenceABC

from kipp_core.backend import BackendOptions, ModelInput, SeqInput, backend_class, default_backend
from kipp_core.checkpoint import Checkpoint
from kipp_core.engine import EngineConfig, LLMEngine
from kipp_core.frontend import Frontend
from kipp_core.gc_heap import heap_frozen
from kipp_core.kv_budget import kv_summary
from kipp_core.long_context import long_context_config
from kipp_core.outputs import RequestOutput
from kipp_core.resolve import DEFAULT_MODEL, resolve_model
from kipp_core.sampling import SamplingParams, TokenLogprob
from kipp_core.scheduler import SchedulerConfig
from kipp_core.sequence import Sequence

log = logging.getLogger("kipp")

Prompt = str | list[int]


class LLM:
    """Load a checkpoint on a backend and generate.

    >>> llm = LLM("kipp-tiny")
    >>> out = llm.generate(["Write a haiku about the sea"], SamplingParams(max_tokens=32))
    >>> out[0].text, out[0].token_ids, out[0].finish_reason
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        backend: str = "oracle",
        dtype: str | None = None,
        *,
        block_size: int = 32,
        num_kv_blocks: int | None = None,
        kv_cache_memory: str | float | None = None,
        kv_sizing: str = "offline",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_waiting: int = 4096,
        enable_prefix_caching: bool = True,
        quant: str | None = None,
        kv_quant: str | None = None,
        enforce_eager: bool = False,
        async_scheduling: bool = True,
        tensor_parallel: int = 1,
        speculative: str | None = None,
        speculative_model: str | None = None,
        num_speculative_tokens: int = 4,
        rope_scaling: dict | str | None = None,
    ):
        if kv_sizing not in ("offline", "serving"):
            raise ValueError(f"kv_sizing must be 'offline' or 'serving', got {kv_sizing!r}")
        self.frontend = Frontend(
            model,
            max_model_len=max_model_len,
            rope_scaling=rope_scaling,
            max_waiting=max_waiting,
            speculative=bool(speculative or speculative_model),
        )
        self.checkpoint, self.config = self.frontend.checkpoint, self.frontend.config
        self.tokenizer, self.chat_template = self.frontend.tokenizer, self.frontend.chat_template
        self.backend_name = default_backend() if backend == "auto" else backend
        self.options = BackendOptions(
            dtype=dtype,
            block_size=block_size,
            num_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            kv_sizing=kv_sizing,
            quant=quant,
            kv_quant=kv_quant,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            tensor_parallel=tensor_parallel,
        )
        cls = backend_class(self.backend_name)
        self.backend = cls(self.checkpoint, self.options)
        spec = None
        if speculative or speculative_model:
            from kipp_core.spec_decode import SpecConfig

            draft = None
            if speculative_model:
                dpath, dentry = resolve_model(speculative_model)
                dck = Checkpoint(dpath, dentry)
                if dck.config.vocab_size != self.config.vocab_size:
                    raise ValueError(
                        f"draft model vocab_size {dck.config.vocab_size} differs from the target's "
                        f"{self.config.vocab_size}: speculation needs the same tokenizer"
                    )
                try:  # the draft runs every position the target does
                    ctx = max_model_len or self.config.max_position_embeddings
                    dck.config = long_context_config(dck.config, dck.entry, ctx, rope_scaling)
                except ValueError as e:
                    raise ValueError(f"draft model: {e}") from None
                draft = cls(dck, self.options)
            spec = SpecConfig(
                method="draft" if draft is not None else (speculative or "ngram"),
                num_speculative_tokens=num_speculative_tokens,
                draft_backend=draft,
            )
        self.engine = LLMEngine(
            self.backend,
            self.tokenizer,
            self.checkpoint.stop_token_ids(),
            EngineConfig(
                max_model_len=max_model_len,
                enable_prefix_caching=enable_prefix_caching,
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_waiting=max_waiting,
                ),
                speculative=spec,
                async_scheduling=async_scheduling,
            ),
        )
        per_token = getattr(self.backend, "kv_bytes_per_token", None)
        if per_token:
            e = self.checkpoint.entry
            model_max = max(self.config.max_position_embeddings, e.max_context_length if e else 0)
            log.info(
                kv_summary(
                    per_token,
                    self.backend.num_blocks,
                    self.backend.block_size,
                    self.engine.max_model_len,
                    model_max,
                )
            )

    @property
    def registry_entry(self):
        return self.checkpoint.entry

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (temperature, top_p, top_k)."""
        return self.frontend.default_sampling_params(**overrides)

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, SequenceABC) and not isinstance(prompt, (bytes, bytearray)):
            return list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        ids = [self.encode_prompt(p) for p in prompts]
        for i, (t, p) in enumerate(zip(ids, plist)):  # validate all before queueing any
            try:
                self.engine.validate_prompt(t, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return self._run(
            [
                (t, p, pr if isinstance(pr, str) else None, False)
                for t, p, pr in zip(ids, plist, prompts)
            ],
            use_tqdm,
        )

    def score(
        self,
        prompt_token_ids: list[list[int]] | list[int],
        top_n: int = 0,
        use_tqdm: bool | None = None,
    ) -> list[list[TokenLogprob | None]]:
        """Each prompt token's logprob given the tokens before it (the first is None), with the
        top-N alternatives, computed in batches."""
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        p = SamplingParams(max_tokens=1, prompt_logprobs=top_n)
        outs = self._run([(list(t), p, None, True) for t in prompt_token_ids], use_tqdm)
        return [o.prompt_logprobs for o in outs]

    def logits(self, token_ids: list[int]):
        """Raw logits of every position, float32 [len(token_ids), vocab_size], run outside the
        scheduler (the engine must be idle)."""
        import numpy as np

        engine = self.engine
        ids = engine.validate_prompt(self.encode_prompt(token_ids), SamplingParams(max_tokens=1))
        if engine.scheduler.has_unfinished():
            raise RuntimeError("logits() needs an idle engine")
        engine._seq_counter += 1
        seq = Sequence(engine._seq_counter, "__logits__", ids, SamplingParams(), 0)
        chunk = engine.config.scheduler.max_num_batched_tokens
        rows = []
        try:
            for start in range(0, len(ids), chunk):
                part = ids[start : start + chunk]
                if not engine.block_manager.allocate(seq, start + len(part)):
                    raise RuntimeError("not enough KV blocks for logits()")
                inp = SeqInput(seq.seq_id, part, start, list(seq.block_table), return_logits=True)
                rows.append(engine.backend.execute(ModelInput([inp]))[0].logits)
        finally:
            engine.block_manager.free(seq)
        return np.concatenate(rows, axis=0)

    def _run(self, items, use_tqdm) -> list[RequestOutput]:
        with heap_frozen():  # full collections skip what was alive before (gc_heap.py)
            return self._drive(items, use_tqdm)

    def _drive(self, items, use_tqdm) -> list[RequestOutput]:
        engine = self.engine
        order = []
        results: dict[str, RequestOutput] = {}
        pending = list(items)
        if use_tqdm is None:
            use_tqdm = len(items) >= 16 and sys.stderr.isatty()
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(items), desc="requests", unit="req", dynamic_ncols=True)
        try:
            while pending or engine.has_unfinished_requests():
                # Keep the waiting queue fed without overfilling it.
                room = engine.config.scheduler.max_waiting - len(engine.scheduler.waiting)
                while pending and room > 0:
                    ids, p, prompt, score_only = pending.pop(0)
                    rid = uuid.uuid4().hex
                    engine.add_request(
                        rid, ids, p, prompt=prompt, score_only=score_only, final_only=True
                    )
                    order.append(rid)
                    room -= p.n
                for out in engine.step():
                    if out.error is not None:
                        raise RuntimeError(f"prompt {order.index(out.request_id)}: {out.error}")
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_all()  # a failed step must not run again; every block is freed
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in order]
