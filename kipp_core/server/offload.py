"""Work that holds the GIL for long, done in a helper process so the event loop keeps serving.

json.loads of a 15 MB body and the `tokenizers` library's encode of a long text both hold the
GIL for their whole call (encode: ~5 s a MB here), so a thread does not help: the loop would
stall with them. Bodies from OFFLOAD_BYTES and texts from OFFLOAD_CHARS go to one spawned worker
process (`kipp serve` starts it with the model, others on first use; it loads the tokenizer
once); smaller ones run inline, where they take under a millisecond. A prompt whose UTF-8
length shows it holds more tokens than the context is refused before any tokenizing.
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


def _least_tokens(body: dict, bytes_per_token: int) -> int:
    """A lower bound on the tokens of the longest prompt in `body` (0 when it has none)."""
    prompt, least = body.get("prompt"), 0
    for p in prompt if isinstance(prompt, list) else [prompt]:
        if isinstance(p, str):
            least = max(least, len(p.encode("utf-8", "surrogatepass")) // bytes_per_token)
        elif isinstance(p, list):
            least = max(least, len(p) if all(isinstance(t, int) for t in p[:64]) else 0)
    messages = body.get("messages")
    if isinstance(messages, list):
        text = sum(
            len(m["content"].encode("utf-8", "surrogatepass"))
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
        least = max(least, text // bytes_per_token)
    return least


def _worker_parse(raw: bytes, max_len: int, bytes_per_token: int):
    from kipp_core.server.errors import APIError
    from kipp_core.server.protocol import parse_json

    try:
        body = parse_json(raw)
    except APIError as e:  # sent back as its message
        return ValueError(e.message)
    # Megabytes of prompt take as long to send back as to parse: a prompt that must hold more
    # tokens than the context is refused here.
    least = _least_tokens(body, bytes_per_token)
    if least >= max_len:
        what = "prompt" if "prompt" in body else "messages"
        return ValueError(
            f"This model's maximum context length is {max_len} tokens; the {what} holds at "
            f"least {least} tokens. Please reduce the length of the {what}.",
            what,
        )
    return body


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

    def start(self) -> None:
        """Start the process now, in the background (its fork pauses this process's threads for
        ~0.1 s, which must not happen beside a request)."""
        if self.model_dir is not None:
            threading.Thread(
                target=lambda: self._executor().submit(int).result(), daemon=True
            ).start()

    def parse_json(self, raw: bytes, max_len: int, bytes_per_token: int) -> dict:
        """protocol.parse_json, in the helper process for a large body (blocks the caller: call
        it from a thread); a prompt that cannot fit the context `max_len` is a 400 there."""
        from kipp_core.server.errors import bad_request
        from kipp_core.server.protocol import parse_json

        if len(raw) < OFFLOAD_BYTES or self.model_dir is None:
            return parse_json(raw)
        out = self._executor().submit(_worker_parse, raw, max_len, bytes_per_token).result()
        if isinstance(out, ValueError):
            raise bad_request(*out.args)
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
