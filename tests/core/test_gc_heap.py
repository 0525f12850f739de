"""freeze_loaded_heap: what is alive goes to the permanent generation (so full collections skip
it), and garbage made before the call is collected first, not frozen."""

from __future__ import annotations

import gc
import weakref

from kipp_core.gc_heap import freeze_loaded_heap
from kipp_core.sampling import SamplingParams


class _Node:
    pass


def test_alive_objects_are_frozen_and_earlier_garbage_collected():
    gc.unfreeze()
    kept = _Node()
    kept.self = kept
    garbage = _Node()
    garbage.self = garbage  # a cycle: only the collector frees it
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_loaded_heap()
        assert frozen == gc.get_freeze_count() > 0
        assert gone() is None
        assert not any(o is kept for o in gc.get_objects())  # tracked no more: frozen
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())


def test_heap_frozen_gives_the_heap_back_and_keeps_a_frozen_one():
    from kipp_core.gc_heap import heap_frozen

    gc.unfreeze()  # whatever another test of this process left
    with heap_frozen():
        inside = gc.get_freeze_count()
    assert inside > 0 and gc.get_freeze_count() == 0  # a library run leaves nothing frozen
    try:
        before = freeze_loaded_heap()
        with heap_frozen():
            pass
        assert gc.get_freeze_count() == before  # a process's frozen heap stays frozen
    finally:
        gc.unfreeze()


def test_generate_leaves_nothing_frozen(llm_factory):
    gc.unfreeze()
    llm = llm_factory("oracle")
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert gc.get_freeze_count() == 0
