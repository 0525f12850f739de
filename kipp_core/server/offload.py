"""Work that holds the GIL for long, done in a helper process so the event loop keeps serving.

json.loads of a 15 MB body and the `tokenizers` library's encode of a long text both hold the
GIL for their whole call (encode: ~5 s a MB here), so a thread does not help: the loop would
stall with them. Bodies from OFFLOAD_BYTES and texts from OFFLOAD_CHARS go to one spawned worker
process (started on first use; it loads the tokenizer once); smaller ones run inline, where they
take under a millisecond. A text whose UTF-8 length shows it holds more tokens than the context
is refused before any tokenizing.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
from pathlib import Path

OFFLOAD_BYTES = 256 << 10
OFFLOAD_CHARS = 8 << 10

_worker_tokenizer = None


def _worker_init(model_dir: str) -> None:
    global _worker_tokenizer
    from kipp_core.tokenizer import Tokenizer

    _worker_tokenizer = Tokenizer(model_dir)


def _worker_encode(text: str) -> list[int]:
    return _worker_tokenizer.encode(text)


def _worker_parse(raw: bytes):
    from kipp_core.server.errors import APIError
    from kipp_core.server.protocol import parse_json

    try:
        return parse_json(raw)
    except APIError as e:  # (APIError holds an aiohttp-free body; sent back as its message)
        return ValueError(e.message)


class Offload:
    """The helper process of one server; `close()` ends it."""

    def __init__(self, model_dir: str | Path | None):
        self.model_dir = str(model_dir) if model_dir is not None else None
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ProcessPoolExecutor(
                    max_workers=1,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_init,
                    initargs=(self.model_dir,),
                )
            return self._pool

    def parse_json(self, raw: bytes) -> dict:
        """protocol.parse_json, in the helper process for a large body (blocks the caller: call
        it from a thread)."""
        from kipp_core.server.errors import bad_request
        from kipp_core.server.protocol import parse_json

        if len(raw) < OFFLOAD_BYTES or self.model_dir is None:
            return parse_json(raw)
        out = self._executor().submit(_worker_parse, raw).result()
        if isinstance(out, ValueError):
            raise bad_request(str(out))
        return out

    def encode(self, tokenizer, text: str) -> list[int]:
        """tokenizer.encode(text), in the helper process for a long text (call from a thread)."""
        if len(text) < OFFLOAD_CHARS or self.model_dir is None:
            return tokenizer.encode(text)
        return self._executor().submit(_worker_encode, text).result()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
