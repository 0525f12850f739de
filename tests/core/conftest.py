"""Fixtures of the core tests."""

from __future__ import annotations

import pytest

from kipp_core.vocab import chat_template


@pytest.fixture(scope="module")
def hf_tok(tiny_path):  # tiny_path: the session fixture in tests/conftest.py
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_path))
    assert tok.chat_template == chat_template()
    return tok
