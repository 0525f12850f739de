"""tools/sweep/pick_tiles.py: the in-graph sweep's winners, by hand-made step times."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "pick_tiles", Path(__file__).parents[2] / "tools" / "sweep" / "pick_tiles.py"
)
pick_tiles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick_tiles)

T = "env:KIPP_CUDA_TUNED="


def test_each_shape_keeps_its_fastest_tile_only_past_the_margin():
    times = {
        "full": 1.840,
        "env:KIPP_UNUSED=1": 1.842,  # baseline 1.841
        T + "affine4/6144x4096/BLOCK_N=16": 1.836,  # -0.005: wins
        T + "affine4/6144x4096/BLOCK_N=4": 1.838,  # wins too, but slower than BLOCK_N=16
        T + "affine4/4096x4096/SPLIT_K=2": 1.840,  # -0.001: inside the margin
        T + "affine4/24576x4096/BLOCK_N=16/num_warps=8": 1.830,
        "da:MIN_TILES_PER_SPLIT=2": 1.800,  # not a tile: never combined
        T + "affine4/4096x12288/BLOCK_N=8+da:BLOCK_N=32": 1.700,  # joined variants neither
    }
    combined, lines = pick_tiles.pick(times, margin=0.002)
    assert combined == "affine4/24576x4096/BLOCK_N=16/num_warps=8;affine4/6144x4096/BLOCK_N=16"
    assert lines[0].startswith("baseline 1.8410 ms (controls 2, spread 0.0020)")
    assert not any("4096x12288" in line for line in lines)


def test_no_winner_gives_an_empty_override():
    times = {"full": 1.84, T + "affine4/4096x4096/BLOCK_N=8": 1.85}
    assert pick_tiles.pick(times, margin=0.002)[0] == ""
