"""Without a GPU, Triton kernels run on CPU through Triton's interpreter; the switch must be set
before triton is first imported, which is why it lives here."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def short_splits(monkeypatch):
    """Decode attention splits of one tile, so that the tests' short contexts really split."""
    from kipp_cuda.kernels import decode_attention as dec

    monkeypatch.setattr(dec, "MIN_TILES_PER_SPLIT", 1)
