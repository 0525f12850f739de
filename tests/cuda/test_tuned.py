"""kernels/tuned.py: the measured GEMV config table and its KIPP_CUDA_TUNED overrides."""

import pytest


def test_tuned_config_override_for_in_graph_sweeps(monkeypatch):
    """KIPP_CUDA_TUNED replaces the named keys of one shape's config (of several, joined with
    ';') and leaves every other shape, and the rest of that config, as the table has them."""
    from kipp_cuda.kernels.tuned import _table, tuned_config

    table = _table()["affine4"]
    monkeypatch.setenv("KIPP_CUDA_TUNED", "affine4/24576x4096/BLOCK_N=16/num_warps=8")
    got = tuned_config("affine4", 24576, 4096)
    assert got == {**table["24576x4096"], "BLOCK_N": 16, "num_warps": 8}
    assert tuned_config("affine4", 4096, 12288) == table["4096x12288"]
    assert tuned_config("q8_0", 24576, 4096) == _table()["q8_0"].get("24576x4096")
    monkeypatch.setenv(
        "KIPP_CUDA_TUNED", "affine4/24576x4096/BLOCK_N=16;affine4/4096x12288/PREFETCH=1;"
    )
    assert tuned_config("affine4", 24576, 4096) == {**table["24576x4096"], "BLOCK_N": 16}
    assert tuned_config("affine4", 4096, 12288) == {**table["4096x12288"], "PREFETCH": 1}
    assert tuned_config("affine4", 4096, 4096) == table["4096x4096"]
    monkeypatch.setenv("KIPP_CUDA_TUNED", "affine4/24576x4096/BLOCK_N=big")
    with pytest.raises(ValueError, match="KIPP_CUDA_TUNED"):
        tuned_config("affine4", 24576, 4096)
