"""Logprobs in the two OpenAI shapes: the legacy completions one (parallel lists) and chat's
list of token entries with UTF-8 bytes."""

from __future__ import annotations

import math
from collections.abc import Iterable

from kipp_core.sampling import TokenLogprob
from kipp_core.tokenizer import Tokenizer

Entry = tuple[int, TokenLogprob | None]  # (token id, its logprob; None for the first prompt token)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -Infinity; OpenAI reports -9999


def completion_logprobs(
    tok: Tokenizer, entries: Iterable[Entry], num_top: int, text_offset: int = 0
) -> tuple[dict, int]:
    """({tokens, token_logprobs, top_logprobs, text_offset}, the offset after the last token).

    As vLLM does, each top_logprobs dict holds the top `num_top` alternatives and the chosen token.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, lp in entries:
        piece = tok.id_to_piece(token_id)
        tokens.append(piece)
        offsets.append(text_offset)
        text_offset += len(piece)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(lp.logprob))
        top = {tok.id_to_piece(t): _finite(v) for t, v in lp.top[:num_top]}
        top.setdefault(piece, _finite(lp.logprob))
        top_logprobs.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return body, text_offset


def _chat_entry(tok: Tokenizer, token_id: int, logprob: float) -> dict:
    return {
        "token": tok.id_to_piece(token_id),
        "logprob": _finite(logprob),
        "bytes": list(tok.token_bytes([token_id])),
    }


def chat_logprobs(tok: Tokenizer, entries: Iterable[Entry], num_top: int) -> dict:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for token_id, lp in entries:
        assert lp is not None
        e = _chat_entry(tok, token_id, lp.logprob)
        e["top_logprobs"] = [_chat_entry(tok, t, v) for t, v in lp.top[:num_top]]
        content.append(e)
    return {"content": content}
