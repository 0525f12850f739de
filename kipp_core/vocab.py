"""The Qwen vocabulary: `tokenizer.json` built from the Qwen BPE ranks (`data/qwen.tiktoken`).

The ranks file is the Qwen tokenizer's own (token id = rank). Merges are recovered from ranks the
way tiktoken merges (the lowest-rank adjacent pair first), so merge priority equals rank. The 26
added tokens sit at their real ids 151643..151668 (QWEN3.md section 4).
"""

from __future__ import annotations

import base64
import functools
from importlib import resources

# The pre-tokenizer regex of Qwen2/Qwen3 (tokenization_qwen2.py PRETOKENIZE_REGEX, tokenizer.json).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)

# (id, content, special) for every added token.
ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
NUM_BPE_TOKENS = 151643


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def load_ranks() -> dict[bytes, int]:
    text = resources.files("kipp_core").joinpath("data/qwen.tiktoken").read_bytes()
    ranks: dict[bytes, int] = {}
    for line in text.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    if len(ranks) != NUM_BPE_TOKENS:
        raise ValueError(f"qwen.tiktoken holds {len(ranks)} tokens, expected {NUM_BPE_TOKENS}")
    return ranks


def _split_by_rank(token: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Run tiktoken's merge loop on `token`, using only merges that rank below the token itself."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best, best_rank = -1, limit
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best_rank:
                best, best_rank = i, r
        if best < 0:
            break
        parts[best : best + 2] = [parts[best] + parts[best + 1]]
    return parts


def build_tokenizer_json() -> dict:
    ranks = load_ranks()
    b2u = bytes_to_unicode()

    def enc(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {enc(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) == 1:
            continue
        parts = _split_by_rank(tok, ranks)
        if len(parts) != 2:
            raise ValueError(f"rank {rank} cannot be reached by one merge")
        merges.append([enc(parts[0]), enc(parts[1])])
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": c,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": s,
            }
            for i, c, s in ADDED_TOKENS
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": PRETOKENIZE_REGEX},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


def tokenizer_config(chat_template: str, base: bool = False) -> dict:
    """tokenizer_config.json as the Qwen3 repos ship it (QWEN3.md section 4)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": c,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for i, c, s in ADDED_TOKENS
        },
        "additional_special_tokens": [c for i, c, s in ADDED_TOKENS if s and i > 151643],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>" if base else "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def chat_template(name: str = "qwen3") -> str:
    """An official chat template, verbatim: Qwen3's (sha256 a55ee1b1...) or a 2507 one."""
    from kipp_core.chat_template import template_text

    return template_text(name)
