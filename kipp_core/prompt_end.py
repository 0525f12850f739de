"""The prompt-end cache: a repeated prompt's first token without a forward pass.

The prefix cache serves a prompt's full blocks, and the tokens after the last full block are
computed again: at least one, since the first sample needs the last row's hidden state. When a
prompt finishes its prefill, the backend can also keep that row's final hidden state in one of
`num_hidden_slots` slots (SeqInput.save_hidden). The entry published for it names the slot and
the block that holds the prompt's tail (the tokens after the last full block). A later request
with the same prompt then takes the cached full blocks, gets a copy of the tail block (it writes
its own tokens after the tail), and samples from the saved hidden state: the backend runs only
the vocabulary head (SeqInput.cached_hidden). The hidden state is a function of the prompt's
tokens alone, so the first token's logits are the cold run's.

An entry is found by a fingerprint of the prompt (its length, first and last 32 ids), not by
walking its blocks: the lookup is on the path of the first token, and walking a 6,890-token
prompt's 215 blocks in Python took ~0.3 ms (hashing all of its ids, ~40 us). Entries that share a
fingerprint are told apart by comparing their whole prompts, and a hit is verified by each full
block's generation (bumped whenever the allocator reuses a block), so the blocks still hold what
they held when the entry was made. Entries are evicted least recently used first
when a slot is needed, and with their tail block when the block allocator reuses it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

NUM_HIDDEN_SLOTS = 64  # saved final hidden states a backend keeps (64 x hidden_size)


@dataclass
class PromptEnd:
    prompt: list[int]  # all of the prompt's token ids
    blocks: list[int]  # its full blocks, in order
    generations: list[int]  # each full block's generation when the entry was made
    hashes: list[int]  # their prefix-cache chain hashes (the hit's sequence publishes after them)
    block: int | None  # the block holding the tail's K/V (None: the prompt fills its blocks)
    slot: int  # the backend's hidden-state slot, also the entry's key while it lives
    fingerprint: int = 0

    @property
    def key(self) -> int:
        return self.slot


class PromptEnds:
    """Slots and entries; the BlockManager owns the blocks they point at."""

    def __init__(self, num_slots: int):
        self.free_slots = list(range(num_slots))
        self.entries: OrderedDict[int, PromptEnd] = OrderedDict()  # LRU order, oldest first
        self._by_print: dict[int, list[PromptEnd]] = {}
        self.reserved: dict[int, tuple[int, int]] = {}  # seq_id -> (slot, prompt length)
        self.hits = 0

    @staticmethod
    def fingerprint(prompt: list[int]) -> int:
        return hash((len(prompt), tuple(prompt[:32]), tuple(prompt[-32:])))

    def find(self, prompt: list[int]) -> PromptEnd | None:
        """The entry for exactly `prompt`, verified or not."""
        for e in self._by_print.get(self.fingerprint(prompt), ()):
            if e.prompt == prompt:
                return e
        return None

    def reserve(self, seq_id: int, num_tokens: int, drop) -> int | None:
        """A slot for the hidden state of seq's last prompt row, evicting the least recently used
        entry (through `drop`, which releases its block) when none is free."""
        if seq_id in self.reserved:
            return self.reserved[seq_id][0]
        if not self.free_slots:
            if not self.entries:
                return None
            drop(next(iter(self.entries.values())))
        slot = self.free_slots.pop()
        self.reserved[seq_id] = (slot, num_tokens)
        return slot

    def unreserve(self, seq_id: int) -> None:
        r = self.reserved.pop(seq_id, None)
        if r is not None:
            self.free_slots.append(r[0])

    def add(self, e: PromptEnd) -> None:
        e.fingerprint = self.fingerprint(e.prompt)
        self.entries[e.key] = e
        self._by_print.setdefault(e.fingerprint, []).append(e)

    def remove(self, e: PromptEnd) -> None:
        del self.entries[e.key]
        same = self._by_print[e.fingerprint]
        same.remove(e)
        if not same:
            del self._by_print[e.fingerprint]
        self.free_slots.append(e.slot)

    def lookup(self, prompt: list[int], blocks, drop) -> PromptEnd | None:
        """The entry for exactly `prompt` whose full blocks are unchanged (each of `blocks[id]`
        still has the recorded generation), or None. An entry with a reused block can never
        verify again (generations only grow), so it is dropped (through `drop`)."""
        e = self.find(prompt)
        if e is None:
            return None
        if [blocks[b].generation for b in e.blocks] != e.generations:
            drop(e)
            return None
        self.entries.move_to_end(e.key)
        return e
