"""The backend contract: the core decides which tokens run and which KV blocks they use; a backend
computes logits for them, samples, and scores.

A step is one `ModelInput`: for each scheduled sequence a run of new tokens (a prefill chunk, one
decode token, or a decode token followed by draft tokens) at positions `start_pos..`, with the block
table that holds its KV. The backend writes the new tokens' K/V into those blocks, attends over the
whole context, and answers with one `SeqOutput` per entry, in order.

A backend may also offer `execute_async(batch) -> PendingOutputs`: it queues the step on the device
and returns at once, so the engine can schedule the next step while this one runs. A token of that
next step may then be `PENDING`: the token the previous step sampled for the same sequence, still
on the device, which the backend substitutes there without a round trip through the host.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from kipp_core.config import ModelConfig
from kipp_core.sampling import SamplerState, TokenLogprob

PENDING = -1  # a token id not yet known to the host: the previous step's sample for this seq
# Prompt-logprob rows a backend turns into logits at a time, so that a long prompt never holds
# [T, vocab] at once: [256, 151936] float32 is 155 MB.
SCORE_CHUNK = 256


def score_in_chunks(targets: list[int], score_rows) -> list:
    """Prompt logprobs of `targets` (row j predicts targets[j]), SCORE_CHUNK rows at a time:
    `score_rows(a, chunk)` scores rows a .. a + len(chunk) - 1 against `chunk`."""
    scores = []
    for a in range(0, len(targets), SCORE_CHUNK):
        scores += score_rows(a, targets[a : a + SCORE_CHUNK])
    return scores


@dataclass
class SeqInput:
    seq_id: int
    token_ids: list[int]  # new tokens; their KV goes to positions start_pos .. start_pos+len-1
    start_pos: int  # tokens already in the KV cache (num_computed_tokens)
    block_table: list[int]
    # Sample the token after the last row. With `draft_token_ids` (the last k of token_ids) the
    # backend verifies the drafts and returns the accepted tokens plus one more.
    sampler: SamplerState | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: np.ndarray | None = None  # [k, vocab] from a draft model; None = deterministic
    num_logprobs: int | None = None  # top-N alternatives for each sampled token
    # Score rows: row i (of token_ids) predicts score_targets[i - score_start].
    score_start: int = 0
    score_targets: list[int] | None = None
    num_score_logprobs: int = 0
    return_logits: bool = False  # return the raw logits of every row (tests, `LLM.logits`)
    # The prompt-end cache (kipp_core.prompt_end), for backends with `num_hidden_slots`:
    # keep the last row's final hidden state in this slot after the step;
    save_hidden: int | None = None
    # or, with token_ids empty, run no layers: copy block copy_block[0]'s K/V into
    # copy_block[1] (before anything this step writes) and sample from this slot's hidden state
    # (return_logits: that one row's logits).
    cached_hidden: int | None = None
    copy_block: tuple[int, int] | None = None


@dataclass
class ModelInput:
    seqs: list[SeqInput]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SeqOutput:
    token_ids: list[int] = field(default_factory=list)  # sampled (accepted drafts + one more)
    logprobs: list[TokenLogprob] | None = None  # one per sampled token when num_logprobs is set
    scores: list[TokenLogprob] | None = None  # one per score target
    logits: np.ndarray | None = None  # [len(token_ids), vocab] float32 when return_logits


@dataclass
class BackendOptions:
    """How to build a backend; each backend reads what applies to it."""

    dtype: str | None = None  # "bfloat16" | "float16" | "float32" | "float64" (oracle)
    block_size: int = 32
    num_blocks: int | None = None  # explicit KV pool size; else from kv_cache_memory
    kv_cache_memory: str | float | None = None  # "4GiB", "512MiB", or a fraction of free memory
    kv_sizing: str = "offline"  # the default without either: "offline" or "serving" (kv_budget)
    quant: str | None = None  # "q8_0" | "affine4" | "affine8", applied at load
    kv_quant: str | None = None  # "q8_0"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    enforce_eager: bool = False  # no CUDA graphs / mx.compile
    tensor_parallel: int = 1
    device: str | None = None


@runtime_checkable
class Backend(Protocol):
    """What the engine needs from a backend. `num_blocks` x `block_size` tokens of KV. A backend
    may also offer `num_hidden_slots` > 0: SeqInput.save_hidden / cached_hidden are then used."""

    config: ModelConfig
    block_size: int
    num_blocks: int

    def execute(self, batch: ModelInput) -> list[SeqOutput]: ...


class PendingOutputs(Protocol):
    """A step queued by `execute_async`; `result()` waits for it."""

    def result(self) -> list[SeqOutput]: ...


BACKENDS = {
    "oracle": "oracle.backend:OracleBackend",
    "cuda": "kipp_cuda.backend:CudaBackend",
    "mlx": "kipp_mlx.backend:MlxBackend",
}


def default_backend() -> str:
    """MLX on Apple silicon, CUDA where a GPU is visible, else the numpy oracle."""
    import platform
    import sys

    if sys.platform == "darwin" and platform.machine() == "arm64":
        if importlib.util.find_spec("mlx") is not None:
            return "mlx"
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            return "cuda"
    return "oracle"


def backend_class(name: str):
    if name == "auto":
        name = default_backend()
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}: choose one of auto, {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        extra = {"cuda": "cuda", "mlx": "mlx"}.get(name)
        hint = f" (pip install -e '.[{extra}]')" if extra else ""
        raise ValueError(f"backend {name!r} is not available: {e}{hint}") from None
