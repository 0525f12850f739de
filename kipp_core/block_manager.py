"""Paged KV blocks: allocation, reference counts, and the content-addressed prefix cache.

A full block is published under a hash chained over its tokens and its parent's hash. A hit is
verified by comparing the token ids themselves and the parent link (block id and generation), so a
hash collision can never serve another prompt's KV. Unreferenced cached blocks stay reusable until
they are evicted, least recently used first; blocks that hold no published content go first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kipp_core.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    generation: int = 0  # bumped on every eviction, so stale parent links never verify
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: tuple[int, int] | None = None  # (block_id, generation) of the previous block


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._by_hash: dict[int, int] = {}
        self._chain: dict[int, list[int]] = {}  # seq_id -> hashes of its published full blocks
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache ---------------------------------------------------------------------------

    @staticmethod
    def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((parent_hash, token_ids))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Verified cached blocks for the start of `seq`, leaving at least one token to compute."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        hits: list[int] = []
        parent_hash, parent = None, None
        tokens = seq.token_ids
        for i in range(limit):
            ids = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.chain_hash(parent_hash, ids)
            bid = self._by_hash.get(h)
            if bid is None:
                break
            b = self.blocks[bid]
            if b.token_ids != ids or b.parent != parent:  # collision or stale chain: no hit
                break
            hits.append(bid)
            parent_hash, parent = h, (bid, b.generation)
        return hits

    def allocate_prefix(self, seq: Sequence) -> None:
        """At admission: take the verified cached prefix blocks and count them as computed."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        hits = self.match_prefix(seq)
        for bid in hits:
            self._take(bid)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self._chain[seq.seq_id] = [self.blocks[b].hash for b in hits]

    def count_admission(self, seq: Sequence) -> None:
        """Prefix-cache statistics, counted once a sequence is actually admitted."""
        if self.enable_prefix_caching:
            self.hit_tokens += seq.num_cached_tokens
            self.query_tokens += seq.num_tokens

    def publish(self, seq: Sequence) -> None:
        """Publish the blocks that `seq` has filled since the last call."""
        if not self.enable_prefix_caching:
            return
        chain = self._chain.setdefault(seq.seq_id, [])
        bs = self.block_size
        # Only blocks of known tokens: a pending sample (async scheduling) has no value yet.
        known = min(seq.num_computed_tokens, seq.num_known_tokens)
        num_full = min(known // bs, len(seq.block_table))
        tokens = None
        while len(chain) < num_full:
            i = len(chain)
            tokens = tokens or seq.token_ids
            ids = tuple(tokens[i * bs : (i + 1) * bs])
            h = self.chain_hash(chain[-1] if chain else None, ids)
            chain.append(h)
            b = self.blocks[seq.block_table[i]]
            if b.hash is not None or h in self._by_hash:
                continue  # already published (a hit), or the same content lives in another block
            prev = self.blocks[seq.block_table[i - 1]] if i else None
            b.hash, b.token_ids = h, ids
            b.parent = (prev.block_id, prev.generation) if prev else None
            self._by_hash[h] = b.block_id

    # -- allocation -----------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold `num_tokens`; all or nothing."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._pop_free())
        return True

    def free(self, seq: Sequence) -> None:
        # Reverse order: a prompt's tail is evicted before its head, which more requests share.
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref_count -= 1
            assert b.ref_count >= 0, f"block {bid} freed twice"
            if b.ref_count == 0:
                (self._free_cached if b.hash is not None else self._free_plain)[bid] = None
        seq.block_table = []
        self._chain.pop(seq.seq_id, None)

    def _take(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            self._free_cached.pop(bid, None)
            self._free_plain.pop(bid, None)
        b.ref_count += 1

    def _pop_free(self) -> int:
        if self._free_plain:
            bid, _ = self._free_plain.popitem(last=False)
        else:
            bid, _ = self._free_cached.popitem(last=False)
            self._evict(self.blocks[bid])
        self.blocks[bid].ref_count = 1
        return bid

    def _evict(self, b: Block) -> None:
        if b.hash is not None and self._by_hash.get(b.hash) == b.block_id:
            del self._by_hash[b.hash]
        b.hash, b.token_ids, b.parent = None, None, None
        b.generation += 1

    def reset_prefix_cache(self) -> None:
        for bid in list(self._free_cached):
            self._evict(self.blocks[bid])
            self._free_plain[bid] = None
        self._free_cached.clear()

    def check_all_free(self) -> None:
        """Leak check for tests: every block unreferenced and in a free list."""
        leaked = [b.block_id for b in self.blocks if b.ref_count]
        assert not leaked, f"KV blocks still referenced: {leaked[:16]}"
        assert self.num_free_blocks == self.num_blocks
