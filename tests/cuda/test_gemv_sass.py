"""The quantized GEMVs' inline PTX compiled for sm_90 on this machine (Triton's own ptxas and
cuobjdump, no GPU): ptxas accepts it, and the int16-x path lowers to dp2a, two weights an
instruction. A subprocess, because the tests here run Triton's interpreter, whose kernels do not
compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _has_cuobjdump() -> bool:
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


@pytest.mark.skipif(not _has_cuobjdump(), reason="this Triton ships no cuobjdump")
def test_int16_x_gemvs_compile_for_sm90_and_use_dp2a(tmp_path):
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    subprocess.run(
        [sys.executable, "tools/sweep/gemv_sass.py", "--configs", "32x32x4", "--json", str(out)],
        cwd=Path(__file__).parents[2],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    rows = {(r["kernel"], r["int_x"]): r for r in json.loads(out.read_text())}
    for kernel in ("q8_0", "affine4"):
        on, off = rows[kernel, True], rows[kernel, False]
        # a thread's 8 rows x 32 weights a K step, one dp2a for every two of them
        assert on["ops"].get("IDP") == on["weights"] / 2, kernel
        assert "IDP" not in off["ops"], kernel
        assert sum(on["ops"].values()) < sum(off["ops"].values()), kernel
    # interleaved scales and biases: one load a (row, group) fewer, 8 a thread a K step
    packed, apart = rows["affine4", True], rows["affine4/separate", True]
    assert packed["ops"]["LDG"] == apart["ops"]["LDG"] - packed["weights"] / 32


_EARLY = """
from kipp_cuda.kernels.affine_gemv import _affine_gemv_kernel as fn
from kipp_cuda.kernels.sass import AFFINE_PACKED_SIG, loop_sass
for bn, bg, nw in ((8, 128, 4), (16, 128, 8)):  # the 8B affine4 qkv/gate_up and o/down tiles
    for prefetch in (0, 2):
        c = dict(BLOCK_N=bn, BLOCK_G=bg, SPLIT_K=1, PDL=True, ASM=True, PREFETCH=prefetch,
                 BITS=4, GROUP=32, INT_X=True, SWIGLU=False, HEAD=False, ROUND=None, PACKED=2)
        print(loop_sass(fn, AFFINE_PACKED_SIG, c, nw)[1])
"""


@pytest.mark.skipif(not _has_cuobjdump(), reason="this Triton ships no cuobjdump")
def test_affine_gemv_first_tile_early_keeps_one_tile_registers():
    """PREFETCH 2 (the tuned 8B affine4 layer tiles) loads the first K step's tile before the PDL
    wait without a second tile in flight: at most PREFETCH 0's registers a thread, so as many
    programs an SM (the first form, a conditional reload in the loop, took 116 against 80)."""
    from tests.cuda.kernel_testing import compile_offline

    regs = [int(n) for n in compile_offline(_EARLY).split()]
    for one_tile, early in zip(regs[::2], regs[1::2]):
        assert early <= one_tile
