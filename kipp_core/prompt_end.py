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

An entry is verified like a prefix hit: the full blocks must match by token ids and parent
links, and then the tail's token ids and its parent link (the last full block's id and
generation) must equal the entry's. Entries are evicted least recently used first when a slot is
needed, and with their tail block when the block allocator reuses it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class PromptEnd:
    key: int
    tail: tuple[int, ...]  # the prompt's tokens after its last full block
    parent: tuple[int, int] | None  # (block_id, generation) of the last full block
    block: int | None  # the block holding the tail's K/V (None: the prompt fills its blocks)
    slot: int  # the backend's hidden-state slot


class PromptEnds:
    """Slots and entries; the BlockManager owns the blocks they point at."""

    def __init__(self, num_slots: int):
        self.free_slots = list(range(num_slots))
        self.entries: OrderedDict[int, PromptEnd] = OrderedDict()  # LRU order, oldest first
        self.reserved: dict[int, tuple[int, int]] = {}  # seq_id -> (slot, prompt length)
        self.hits = 0

    @staticmethod
    def key(last_hash: int | None, tail: tuple[int, ...]) -> int:
        return hash(("end", last_hash, tail))

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
        self.entries[e.key] = e

    def remove(self, e: PromptEnd) -> None:
        del self.entries[e.key]
        self.free_slots.append(e.slot)

    def lookup(self, key: int, tail: tuple[int, ...], parent) -> PromptEnd | None:
        e = self.entries.get(key)
        if e is None or e.tail != tail or e.parent != parent:
            return None
        self.entries.move_to_end(key)
        return e
