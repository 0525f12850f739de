"""The prompt-end cache's block bookkeeping (kipp_core.prompt_end with the BlockManager): hits,
tail blocks reused under pressure, slots evicted, nothing leaked or handed out twice."""

from __future__ import annotations

from kipp_core.block_manager import BlockManager
from kipp_core.sampling import SamplingParams
from kipp_core.sequence import Sequence

BS = 4


def _run_prompt(bm: BlockManager, seq_id: int, tokens: list[int]) -> Sequence:
    """Admit and 'compute' a prompt the way the engine does, publishing its end."""
    seq = Sequence(seq_id, str(seq_id), list(tokens), SamplingParams(), 0)
    bm.allocate_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens)
    if seq.cached_end is None:
        slot = bm.reserve_end(seq, seq.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.publish(seq)
        if slot is not None:
            bm.publish_end(seq)
    return seq


def test_hit_takes_every_token_and_copies_the_tail_into_a_new_block():
    bm = BlockManager(8, BS, num_hidden_slots=2)
    a = _run_prompt(bm, 1, list(range(10)))  # 2 full blocks + a tail of 2
    b = _run_prompt(bm, 2, list(range(10)))
    slot, src, dst = b.cached_end
    assert b.num_computed_tokens == b.num_cached_tokens == 10
    assert b.block_table[:2] == a.block_table[:2] and src == a.block_table[2] != dst
    assert b.block_table[2] == dst
    c = _run_prompt(bm, 3, list(range(9)) + [99])  # another last token: full blocks only
    assert c.cached_end is None and c.num_cached_tokens == 8
    for s in (a, b, c):
        bm.free(s)
    bm.check_all_free()


def test_tail_blocks_are_reused_last_and_never_twice():
    bm = BlockManager(4, BS, num_hidden_slots=2)
    a = _run_prompt(bm, 1, list(range(6)))
    tail = a.block_table[1]
    bm.free(a)  # block 0 is a cached full block, block 1 an entry's tail
    assert bm.num_free_blocks == 4 and len(bm.ends.entries) == 1
    b = Sequence(2, "2", list(range(100, 116)), SamplingParams(), 0)
    bm.allocate_prefix(b)
    assert bm.allocate(b, 16)  # all four blocks: the tail's entry is dropped
    assert sorted(b.block_table) == [0, 1, 2, 3] and b.block_table[-1] == tail
    assert not bm.ends.entries and bm.num_free_blocks == 0
    bm.free(b)
    bm.check_all_free()
    assert sorted(bm.ends.free_slots) == [0, 1]


def test_slots_are_evicted_least_recently_used_first():
    bm = BlockManager(16, BS, num_hidden_slots=2)
    p = [list(range(k, k + 6)) for k in (0, 100, 200)]
    seqs = [_run_prompt(bm, i, q) for i, q in enumerate(p)]  # the third evicts the first
    hit = _run_prompt(bm, 10, p[1])
    miss = _run_prompt(bm, 11, p[0])
    assert hit.cached_end is not None and miss.cached_end is None
    for s in (*seqs, hit, miss):
        bm.free(s)
    bm.check_all_free()


def test_a_reservation_is_released_when_its_sequence_is_freed():
    bm = BlockManager(8, BS, num_hidden_slots=1)
    seq = Sequence(1, "1", list(range(6)), SamplingParams(), 0)
    bm.allocate_prefix(seq)
    assert bm.allocate(seq, 6) and bm.reserve_end(seq, 6) == 0
    bm.free(seq)  # aborted before its step came back
    bm.check_all_free()
    assert bm.ends.free_slots == [0] and not bm.ends.entries


def test_an_entry_whose_full_block_was_reused_is_dropped_not_served():
    bm = BlockManager(8, BS, num_hidden_slots=2)
    a = _run_prompt(bm, 1, list(range(10)))  # blocks 0, 1 full, block 2 the tail
    bm.free(a)  # free order: the tail to its pool, then 1 and 0 to the cached pool (LRU)
    other = Sequence(2, "2", list(range(100, 124)), SamplingParams(), 0)
    bm.allocate_prefix(other)
    assert bm.allocate(other, 24)  # the 5 plain blocks, then block 1: evicted and rewritten
    assert a.seq_id and 1 in other.block_table and 0 not in other.block_table
    bm.free(other)
    again = _run_prompt(bm, 3, list(range(10)))
    # Block 1 changed: no prompt-end hit, only block 0 through the prefix cache.
    assert again.cached_end is None and again.num_cached_tokens == BS
    assert len(bm.ends.entries) == 1  # the stale entry went; `again` published a new one
    bm.free(again)
    hit = _run_prompt(bm, 4, list(range(10)))
    assert hit.cached_end is not None and hit.num_cached_tokens == 10
    bm.free(hit)
    bm.check_all_free()


def test_a_hash_collision_never_serves_another_prompt(monkeypatch):
    from kipp_core.prompt_end import PromptEnds

    monkeypatch.setattr(PromptEnds, "fingerprint", staticmethod(lambda prompt: 0))  # all collide
    bm = BlockManager(16, BS, num_hidden_slots=2)
    a = _run_prompt(bm, 1, list(range(10)))
    b = _run_prompt(bm, 2, list(range(1, 11)))  # same length, other tokens, same fingerprint
    assert b.cached_end is None and b.num_cached_tokens == 0
    c = _run_prompt(bm, 3, list(range(10)))
    assert c.cached_end is not None and c.block_table[:2] == a.block_table[:2]
    d = _run_prompt(bm, 4, list(range(1, 11)))  # both entries live under one fingerprint
    assert d.cached_end is not None and d.block_table[:2] == b.block_table[:2]
    for s in (a, b, c, d):
        bm.free(s)
    bm.check_all_free()
