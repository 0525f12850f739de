"""Paged KV blocks: allocation, reference counts, and the content-addressed prefix cache.

A full block is published under a hash chained over its tokens and its parent's hash. A hit is
verified by comparing the token ids themselves and the parent link (block id and generation), so a
hash collision can never serve another prompt's KV. Unreferenced cached blocks stay reusable until
they are evicted, least recently used first; blocks that hold no published content go first, and
the tail blocks of prompt-end entries (kipp_core.prompt_end) last.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kipp_core.prompt_end import PromptEnd, PromptEnds
from kipp_core.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    generation: int = 0  # bumped on every eviction, so stale parent links never verify
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: tuple[int, int] | None = None  # (block_id, generation) of the previous block
    end_key: int | None = None  # the prompt-end entry whose tail this block holds


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_hidden_slots: int = 0,
    ):
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
        self._free_end: OrderedDict[int, None] = OrderedDict()  # tails of prompt-end entries
        self._by_hash: dict[int, int] = {}
        self._chain: dict[int, list[int]] = {}  # seq_id -> hashes of its published full blocks
        self.hit_tokens = 0
        self.query_tokens = 0
        self.ends = PromptEnds(num_hidden_slots)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached) + len(self._free_end)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # -- prefix cache ---------------------------------------------------------------------------

    @staticmethod
    def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((parent_hash, token_ids))

    def match_prefix(self, seq: Sequence, limit: int | None = None) -> list[int]:
        """Verified cached blocks for the start of `seq`, leaving at least one token to compute
        (or at most `limit` blocks)."""
        return self._match(seq, limit)[0]

    def _match(self, seq: Sequence, limit: int | None) -> tuple[list[int], list[int]]:
        """(the verified hits, their chain hashes). A prefix hit's TTFT is mostly this loop (215
        blocks for a 6,890-token prompt), hence the locals."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return [], []
        bs = self.block_size
        if limit is None:
            limit = (seq.num_tokens - 1) // bs
        hits: list[int] = []
        hashes: list[int] = []
        parent_hash, parent = None, None
        tokens, by_hash, blocks = seq.token_ids, self._by_hash, self.blocks
        for ids in [tuple(tokens[i : i + bs]) for i in range(0, limit * bs, bs)]:
            h = hash((parent_hash, ids))  # chain_hash, inline
            bid = by_hash.get(h)
            if bid is None:
                break
            b = blocks[bid]
            if b.token_ids != ids or b.parent != parent:  # collision or stale chain: no hit
                break
            hits.append(bid)
            hashes.append(h)
            parent_hash, parent = h, (bid, b.generation)
        return hits, hashes

    def allocate_prefix(self, seq: Sequence) -> None:
        """At admission: take the verified cached prefix blocks and count them as computed. A
        prompt-end hit takes every token: the tail block is copied (seq.cached_end)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        end = self._match_end(seq)
        if end is not None:
            hits, hashes = end.blocks, list(end.hashes)
        else:
            hits, hashes = self._match(seq, None)
        blocks, ends, cached, plain = (
            self.blocks,
            self._free_end,
            self._free_cached,
            self._free_plain,
        )
        for bid in hits:  # _take and _pool, inline: this loop is on the first token's path
            b = blocks[bid]
            if not b.ref_count:
                (ends if b.end_key is not None else cached if b.hash is not None else plain).pop(
                    bid, None
                )
            b.ref_count += 1
        seq.block_table = list(hits)
        if end is not None and end.block is not None:
            src = end.block
            self._take(src)  # the copy's source must not be handed out as its target
            if self.num_free_blocks:
                seq.block_table.append(self._pop_free())
            else:
                end = None  # no block for the copy: compute the tail (hits are its full blocks)
            self._release(src)
        seq.num_computed_tokens = len(hits) * self.block_size
        if end is not None:
            seq.num_computed_tokens = seq.num_tokens
            dst = seq.block_table[-1] if end.block is not None else None
            seq.cached_end = (end.slot, end.block, dst)
        seq.num_cached_tokens = seq.num_computed_tokens
        self._chain[seq.seq_id] = hashes

    def count_admission(self, seq: Sequence) -> None:
        """Prefix-cache statistics, counted once a sequence is actually admitted."""
        if self.enable_prefix_caching:
            self.hit_tokens += seq.num_cached_tokens
            self.query_tokens += seq.num_tokens
            self.ends.hits += seq.cached_end is not None

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
            self._release(bid)
        seq.block_table = []
        seq.cached_end = None
        self._chain.pop(seq.seq_id, None)
        self.ends.unreserve(seq.seq_id)

    def _release(self, bid: int) -> None:
        b = self.blocks[bid]
        b.ref_count -= 1
        assert b.ref_count >= 0, f"block {bid} freed twice"
        if b.ref_count == 0:
            self._pool(b)[bid] = None

    def _pool(self, b: Block) -> OrderedDict[int, None]:
        if b.end_key is not None:
            return self._free_end
        return self._free_cached if b.hash is not None else self._free_plain

    def _take(self, bid: int) -> None:
        b = self.blocks[bid]
        if not b.ref_count:
            self._pool(b).pop(bid, None)
        b.ref_count += 1

    def _pop_free(self) -> int:
        for pool in (self._free_plain, self._free_cached, self._free_end):
            if pool:
                bid, _ = pool.popitem(last=False)
                break
        self.blocks[bid].ref_count = 1  # first: dropping its prompt end must not free it again
        self._evict(self.blocks[bid])
        return bid

    def _evict(self, b: Block) -> None:
        if b.end_key is not None:
            self._drop_end(self.ends.entries[b.end_key])
        if b.hash is not None and self._by_hash.get(b.hash) == b.block_id:
            del self._by_hash[b.hash]
        b.generation += 1
        b.hash, b.token_ids, b.parent = None, None, None

    def reset_prefix_cache(self) -> None:
        for e in list(self.ends.entries.values()):
            self._drop_end(e)
        for bid in list(self._free_cached):
            self._evict(self.blocks[bid])
            self._free_plain[bid] = None
        self._free_cached.clear()

    # -- prompt-end cache (kipp_core.prompt_end) ------------------------------------------------

    def reserve_end(self, seq: Sequence, num_tokens: int) -> int | None:
        """A hidden-state slot for the step that finishes seq's first `num_tokens` tokens (its
        prompt), or None. The entry is published after that step (publish_end)."""
        if not self.enable_prefix_caching or num_tokens < self.block_size:
            return None
        return self.ends.reserve(seq.seq_id, num_tokens, self._drop_end)

    def publish_end(self, seq: Sequence) -> None:
        """After the step that saved the hidden state of seq's last prompt row: publish it, with
        the block holding the tail. Needs the full blocks published first (publish)."""
        r = self.ends.reserved.pop(seq.seq_id, None)
        if r is None:
            return
        slot, n = r
        full = n // self.block_size
        chain = self._chain.get(seq.seq_id, [])[:full]
        full_blocks = [self._by_hash.get(h) for h in chain]
        prompt = seq.token_ids[:n]
        b = self.blocks[seq.block_table[full]] if n % self.block_size else None
        if (
            len(chain) < full
            or None in full_blocks
            or self.ends.lookup(prompt, self.blocks, self._drop_end) is not None  # (stale: dropped)
            or (b and b.end_key is not None)
        ):
            self.ends.free_slots.append(slot)  # nothing new to keep
            return
        gens = [self.blocks[bid].generation for bid in full_blocks]
        self.ends.add(PromptEnd(prompt, full_blocks, gens, chain, b and b.block_id, slot))
        if b is not None:
            b.end_key = slot

    def _match_end(self, seq: Sequence) -> PromptEnd | None:
        """The verified entry for all of seq's tokens, found without a walk over its blocks
        (kipp_core.prompt_end)."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs or not self.ends.entries:
            return None
        ids = seq.token_ids if seq.output_token_ids else seq.prompt_token_ids  # (no list copy)
        return self.ends.lookup(ids, self.blocks, self._drop_end)

    def _drop_end(self, e: PromptEnd) -> None:
        self.ends.remove(e)
        if e.block is not None:
            b = self.blocks[e.block]
            b.end_key = None
            if b.ref_count == 0:
                self._free_end.pop(b.block_id, None)
                self._pool(b)[b.block_id] = None

    def check_all_free(self) -> None:
        """Leak check for tests: every block unreferenced and in a free list."""
        leaked = [b.block_id for b in self.blocks if b.ref_count]
        assert not leaked, f"KV blocks still referenced: {leaked[:16]}"
        assert self.num_free_blocks == self.num_blocks
        assert not self.ends.reserved, f"hidden slots still reserved: {self.ends.reserved}"
