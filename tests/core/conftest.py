"""Fixtures of the core tests."""

from __future__ import annotations

import pytest

from kipp_core.vocab import chat_template


@pytest.fixture(scope="module")
def hf_tok(tiny_path):  # tiny_path: the run-wide fixture in tests/conftest.py
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_path))
    assert tok.chat_template == chat_template()
    return tok


@pytest.fixture(scope="module")
def hf_toks(tiny_path, tmp_path_factory):
    """name -> transformers' tokenizer of kipp-tiny carrying that official chat template."""
    import json
    import shutil

    transformers = pytest.importorskip("transformers")
    out = {}
    for name in ("qwen3", "qwen3-instruct-2507", "qwen3-thinking-2507"):
        d = tmp_path_factory.mktemp(name)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(tiny_path / f, d / f)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = chat_template(name)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        out[name] = transformers.AutoTokenizer.from_pretrained(str(d))
        assert out[name].chat_template == chat_template(name)
    return out
