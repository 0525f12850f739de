"""How large a KV cache `kipp serve` takes by default, in blocks, and the sentence that says why.

A server is KV-bound when the scheduler cannot run `max_num_seqs` sequences for want of blocks
(it waits or preempts). The serving default gives every one of them room for SERVE_SEQ_TOKENS
tokens (or max_model_len, if shorter): a load of 256 streams with prompt and output uniform in
[100, 1,024] then never waits for KV, and neither does vLLM's default random benchmark
(1,024 in, 128 out). Longer sequences still run (one full context always fits); they share the
pool. The pool never takes more than SERVE_FRACTION of the memory free after the weights (vLLM's
gpu_memory_utilization, though vLLM takes it of the whole card whatever the model). So a small
model stops at what its streams can use: Qwen3-0.6B at 256 sequences takes 56 GiB (112 KiB a
token), 43% of a 139 GB H200, and a 32B model the 90%.

`kv_summary` is the budget in one log line, written at start-up whatever the backend: the memory a
token of context takes, the tokens the pool holds, and the longest context that fits in it.
"""

from __future__ import annotations

from dataclasses import dataclass

SERVE_FRACTION = 0.9  # of the memory free after the weights; the rest is the runner's
SERVE_SEQ_TOKENS = 2048  # tokens of room for each of max_num_seqs sequences
GiB = 2**30


@dataclass(frozen=True)
class KVBudget:
    """A KV pool size: blocks, their bytes, and why this size (for the start-up log line)."""

    num_blocks: int
    nbytes: int
    why: str


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def serving_budget(
    free_bytes: int, bytes_per_block: int, block_size: int, max_num_seqs: int, max_model_len: int
) -> KVBudget:
    """Room for `max_num_seqs` sequences of min(max_model_len, SERVE_SEQ_TOKENS) tokens and for
    one of max_model_len, at most SERVE_FRACTION of `free_bytes`."""
    for name, v in (
        ("free_bytes", free_bytes),
        ("bytes_per_block", bytes_per_block),
        ("block_size", block_size),
        ("max_num_seqs", max_num_seqs),
        ("max_model_len", max_model_len),
    ):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    seq = min(max_model_len, SERVE_SEQ_TOKENS)
    streams, context = max_num_seqs * _cdiv(seq, block_size), _cdiv(max_model_len, block_size)
    want = max(streams, context)
    cap = int(SERVE_FRACTION * free_bytes) // bytes_per_block
    room = f"{max_num_seqs} sequences of {seq:,} tokens"
    if context > streams:
        room = f"one context of {max_model_len:,} tokens"
    free = f"{SERVE_FRACTION:.0%} of the {free_bytes / GiB:.1f} GiB free"
    if want <= cap:
        why = f"serving default: room for {room}, within {free}"
        n = want
    else:
        need = want * bytes_per_block / GiB
        why = f"serving default: {free}; room for {room} would need {need:.1f} GiB"
        n = cap
    return KVBudget(n, n * bytes_per_block, why)


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
