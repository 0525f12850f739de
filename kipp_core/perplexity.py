"""Perplexity of a token stream by strided windows, the method of the transformers guide
"Perplexity of fixed-length models": windows of `ctx` tokens advance by `stride`, and each window
scores only the tokens that no earlier window scored (the first window all but its first token)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    begin: int  # the window is tokens[begin:end]
    end: int
    first_scored: int  # tokens[first_scored:end] count towards the perplexity


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood (nats per scored token)
    num_tokens: int  # tokens in the text
    num_scored: int  # tokens whose NLL counts
    num_evaluated: int  # tokens run through the model (windows overlap)
    num_windows: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.num_evaluated / self.seconds if self.seconds > 0 else float("inf")


def windows(num_tokens: int, ctx: int, stride: int) -> list[Window]:
    """The windows of the transformers guide's loop, in order."""
    if ctx < 2:
        raise ValueError(f"ctx must be at least 2 tokens, got {ctx}")
    if not 1 <= stride <= ctx:
        raise ValueError(f"stride must be in [1, ctx={ctx}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + ctx, num_tokens)
        trg_len = end - prev_end
        # Labels are shifted inside the model, so a window never scores its own first token.
        out.append(Window(begin, end, max(begin + 1, end - trg_len)))
        prev_end = end
        if end == num_tokens:
            break
    return out


def perplexity(
    llm, token_ids: list[int], ctx: int = 512, stride: int = 256, use_tqdm: bool | None = None
) -> PerplexityResult:
    """Perplexity of `token_ids` under `llm` (a kipp_core.llm.LLM); all windows are scored in
    one batched `LLM.score` call."""
    limit = llm.engine.max_model_len
    if ctx >= limit:
        raise ValueError(f"ctx {ctx} must be below the context limit of {limit} tokens")
    wins = windows(len(token_ids), ctx, stride)
    t0 = time.perf_counter()
    scores = llm.score([token_ids[w.begin : w.end] for w in wins], use_tqdm=use_tqdm)
    seconds = time.perf_counter() - t0
    nll, n = 0.0, 0
    for w, rows in zip(wins, scores):
        for lp in rows[w.first_scored - w.begin :]:
            nll -= lp.logprob
            n += 1
    mean = nll / n
    return PerplexityResult(
        perplexity=math.exp(mean),
        nll=mean,
        num_tokens=len(token_ids),
        num_scored=n,
        num_evaluated=sum(w.end - w.begin for w in wins),
        num_windows=len(wins),
        seconds=seconds,
    )
