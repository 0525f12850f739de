"""Tokenizer over the `tokenizers` library, plus an incremental detokenizer for streaming.

Byte-level BPE decodes to the concatenation of each token's bytes, read as UTF-8 with `errors=
"replace"`; the incremental detokenizer keeps exactly that, holding back an incomplete UTF-8 tail so
a stream never shows half a character.
"""

from __future__ import annotations

import codecs
import functools
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from kipp_core.vocab import bytes_to_unicode


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> tuple[HFTokenizer, tuple[bytes, ...], frozenset]:
    """The parsed tokenizer.json: the library's tokenizer, each id's bytes, the special ids. Kept
    per file version, as every LLM and server of one process over one model reads the same file
    (parsing the 151k-token vocabulary takes about a second)."""
    try:
        tok = HFTokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception on a corrupt file
        raise ValueError(f"{path} could not be loaded: {e}") from None
    u2b = {c: b for b, c in bytes_to_unicode().items()}
    pieces: list[bytes] = [b""] * tok.get_vocab_size(with_added_tokens=True)
    for piece, i in tok.get_vocab(with_added_tokens=False).items():
        pieces[i] = bytes(u2b[c] for c in piece)
    special = set()
    for i, t in tok.get_added_tokens_decoder().items():
        if i >= len(pieces):
            pieces.extend([b""] * (i + 1 - len(pieces)))
        pieces[i] = t.content.encode("utf-8")
        if t.special:
            special.add(i)
    return tok, tuple(pieces), frozenset(special)


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.model_dir = model_dir
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer.json not found in {model_dir}")
        st = path.stat()
        self._tok, self._bytes, self.special_ids = _load(str(path), st.st_mtime_ns, st.st_size)
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict = json.loads(cfg_path.read_text("utf-8")) if cfg_path.exists() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        self.vocab_size = len(self._bytes)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special tokens are added (Qwen adds no BOS)."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.token_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def token_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        out = []
        for i in ids:
            i = int(i)
            if i < 0:
                raise ValueError(f"token id {i} is negative")
            if i >= self.vocab_size:  # embedding padding rows (151669..151935) decode to nothing
                continue
            if skip_special_tokens and i in self.special_ids:
                continue
            out.append(self._bytes[i])
        return b"".join(out)

    def id_to_piece(self, i: int) -> str:
        """The token's text for logprob listings (bytes that are not valid UTF-8 are escaped)."""
        b = self._bytes[i] if 0 <= i < self.vocab_size else b""
        return b.decode("utf-8", errors="backslashreplace")

    def token_str(self, i: int) -> str | None:
        """Id i's own string in the vocabulary (byte-level: "Ġhello"), as transformers'
        convert_ids_to_tokens gives it; None past the vocabulary."""
        return self._tok.id_to_token(i)

    def token_to_id(self, piece: str) -> int | None:
        return self._tok.token_to_id(piece)

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back only complete UTF-8 text."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tok
        self._skip = skip_special_tokens
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def add(self, token_id: int) -> str:
        delta = self._dec.decode(self._tok.token_bytes([token_id], self._skip))
        self.text += delta
        return delta

    def flush(self) -> str:
        """End of stream: a dangling partial character becomes U+FFFD, as `decode` would give."""
        delta = self._dec.decode(b"", final=True)
        self.text += delta
        return delta
