"""Random admissions, decodes and frees against a small block pool, with a shadow of what each
block holds: whatever the prefix cache or the prompt-end cache serves (full blocks, a tail block's
copy, a saved hidden state) must hold exactly the tokens of the prompt that takes it, under
eviction, reuse of entries' blocks and slot pressure. Prompts come from a small alphabet and a few
shared stems, so prefixes, repeats and fingerprint-equal prompts are common."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.block_manager import BlockManager
from kipp_core.prompt_end import PromptEnds
from kipp_core.sampling import SamplingParams
from kipp_core.sequence import Sequence

BS = 4


class Shadow:
    """The engine's side, with the KV contents kept as token ids per block slot."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.content: dict[int, list[int | None]] = {}
        self.hidden: dict[int, list[int]] = {}  # slot -> the prompt whose last row it holds
        self.next_id = 0
        self.hits = 0

    def write(self, seq: Sequence, start: int, end: int) -> None:
        tokens = seq.token_ids
        for p in range(start, end):
            bid = seq.block_table[p // BS]
            self.content.setdefault(bid, [None] * BS)[p % BS] = tokens[p]

    def admit(self, prompt: list[int]) -> Sequence | None:
        self.next_id += 1
        seq = Sequence(self.next_id, str(self.next_id), list(prompt), SamplingParams(), 0)
        self.bm.allocate_prefix(seq)
        n = len(prompt)
        cached = seq.num_cached_tokens
        full = cached // BS if seq.cached_end is None else n // BS
        for i in range(full):  # every served full block holds this prompt's tokens
            assert self.content[seq.block_table[i]] == prompt[i * BS : (i + 1) * BS]
        if seq.cached_end is not None:
            slot, src, dst = seq.cached_end
            assert self.hidden[slot] == prompt  # the saved hidden state is this prompt's
            if src is not None:
                tail = prompt[full * BS :]
                assert self.content[src][: len(tail)] == tail
                assert dst == seq.block_table[-1] and dst != src
                self.content[dst] = list(self.content[src])
            self.hits += 1
            seq.cached_end = None
        if not self.bm.allocate(seq, n):
            self.bm.free(seq)
            return None
        if cached < n:
            slot = self.bm.reserve_end(seq, n)
            self.write(seq, cached, n)
            seq.num_computed_tokens = n
            self.bm.publish(seq)
            if slot is not None:
                self.hidden[slot] = list(prompt)
                self.bm.publish_end(seq)
        return seq

    def decode(self, seq: Sequence, token: int) -> bool:
        seq.output_token_ids.append(token)
        if not self.bm.allocate(seq, seq.num_tokens):
            seq.output_token_ids.pop()
            return False
        self.write(seq, seq.num_tokens - 1, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        self.bm.publish(seq)
        return True


def _prompt(rng: np.random.Generator, stems: list[list[int]]) -> list[int]:
    stem = stems[rng.integers(len(stems))]
    cut = int(rng.integers(0, len(stem) + 1))
    tail = rng.integers(0, 3, int(rng.integers(0, 9))).tolist()
    p = stem[:cut] + tail
    return p or [1]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("collide", [False, True], ids=["fingerprints", "one-fingerprint"])
def test_served_blocks_and_hidden_states_always_hold_the_prompt(seed, collide, monkeypatch):
    if collide:  # every prompt shares one fingerprint: the full comparison must tell them apart
        monkeypatch.setattr(PromptEnds, "fingerprint", staticmethod(lambda prompt: 0))
    rng = np.random.default_rng(seed)
    bm = BlockManager(int(rng.integers(6, 14)), BS, num_hidden_slots=int(rng.integers(1, 7)))
    sh = Shadow(bm)
    stems = [rng.integers(0, 3, 14).tolist() for _ in range(3)]
    live: list[Sequence] = []
    sent: list[list[int]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.5 and len(live) < 4:
            again = sent and rng.random() < 0.4  # a recent prompt again: the prompt-end case
            prompt = sent[-int(rng.integers(1, min(len(sent), 4) + 1))] if again else None
            prompt = prompt or _prompt(rng, stems)
            sent.append(prompt)
            seq = sh.admit(prompt)
            if seq is not None:
                live.append(seq)
        elif op < 0.75 and live:
            seq = live[int(rng.integers(len(live)))]
            if not sh.decode(seq, int(rng.integers(0, 3))):
                live.remove(seq)
                bm.free(seq)
        elif live:
            bm.free(live.pop(int(rng.integers(len(live)))))
    for seq in live:
        bm.free(seq)
    bm.check_all_free()
    assert sh.hits > 0, "the run never hit the prompt-end cache: it tested nothing"
