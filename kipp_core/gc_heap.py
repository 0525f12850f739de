"""Python's full collections scan every container alive, and after a model and a tokenizer load
that is a large, long-lived heap (the BPE tables alone are 151k-entry dicts): with 256 requests
decoding, a full pass stalled an engine step by up to 38 ms about every 30 steps (step p99 40 ms
against a 4 ms median: tools/profile/engine_message.py --no-freeze). `freeze_loaded_heap` moves
what is alive after loading to the collector's permanent generation, as vLLM's engine core does,
so the full passes scan only what requests allocate (p99 10 ms). Called in the processes Kipp owns
(the engine process, `kipp serve`, `kipp bench`), never from the library: a program's objects
frozen for good could never be collected as cycles. The library's offline runs (LLM.generate)
hold the heap frozen only while they run (`heap_frozen`), then give it back to the collector."""

from __future__ import annotations

import gc
from contextlib import contextmanager


def freeze_loaded_heap() -> int:
    """Collect, then freeze every object still alive. Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def heap_frozen():
    """Freeze what is alive for the duration, then unfreeze it; a heap already frozen (by
    freeze_loaded_heap) stays as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()  # no collection first: garbage frozen here is collected after the run
    try:
        yield
    finally:
        gc.unfreeze()
