"""The KV budget in one log line, written at start-up whatever the backend: the memory a token of
context takes, the tokens the pool holds, and the longest context that fits in it."""

from __future__ import annotations


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def kv_summary(
    bytes_per_token: float, num_blocks: int, block_size: int, max_model_len: int, model_max: int
) -> str:
    """`model_max`: the longest context the model may run (its YaRN recipe's, where it has one)."""
    capacity = num_blocks * block_size
    fits = min(capacity, model_max)
    return (
        f"KV cache: {_size(bytes_per_token)} a token; {num_blocks:,} blocks of {block_size} = "
        f"{capacity:,} tokens in {_size(capacity * bytes_per_token)}; the longest context that "
        f"fits: {fits:,} tokens (the model allows {model_max:,}, max_model_len is "
        f"{max_model_len:,})"
    )
