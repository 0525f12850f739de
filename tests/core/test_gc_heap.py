"""freeze_loaded_heap: what is alive goes to the permanent generation (so full collections skip
it), and garbage made before the call is collected first, not frozen."""

from __future__ import annotations

import gc
import weakref

from kipp_core.gc_heap import freeze_loaded_heap


class _Node:
    pass


def test_alive_objects_are_frozen_and_earlier_garbage_collected():
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
