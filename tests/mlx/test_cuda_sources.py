"""Every MLX CUDA kernel compiles, with NVRTC for sm_90, at the template values the registry
shapes and dtypes use: a GPU-free check that the CUDA twins are valid CUDA (the Metal twins are
compiled only where Metal runs, by the ladder). A deliberately broken source must fail, so the
check can fail."""

from __future__ import annotations

import itertools

import pytest

from kipp_mlx.kernels import add_rms_norm as an
from kipp_mlx.kernels import affine_gemv as ag
from kipp_mlx.kernels import decode_attention as da
from kipp_mlx.kernels import qk_norm_rope as qr
from kipp_mlx.kernels import swiglu as sw
from tests.mlx import nvrtc

pytestmark = pytest.mark.skipif(nvrtc.available() is not None, reason=str(nvrtc.available()))


def cases():
    """bf16 at the registry's layouts; float32 where a 16-byte load holds 4 values, not 8."""
    for t, wide in (("bfloat16", True), ("float32", False)):
        for bits in (4, 8) if wide else (4,):
            yield (
                f"affine_gemv-{t}-{bits}",
                [("x", t), ("w", "uint32"), ("scales", t), ("biases", t)],
                [("out", t)],
                ag._CUDA,
                "",
                [("T", t), ("BITS", bits), ("MM", 3), ("ROWS", 2), ("WARPS", 4), ("UNROLL", 4)],
            )
        variants = ("attention", "mma") if wide else ("attention",)  # mma: 16-bit only
        heads = ((16, 8), (64, 8)) if wide else ((32, 8),)
        for which, (hq, hkv) in itertools.product(variants, heads):
            for direct in (True, False) if wide else (False,):
                ot = t if direct else "float32"
                yield (
                    f"decode_{which}-{t}-{hq}-{direct}",
                    [
                        ("q", t),
                        ("kv_pool", t),
                        ("block_tables", "int32"),
                        ("context_lens", "int32"),
                        ("scale", "float32"),
                    ],
                    [("out", ot), ("ml", "float32")],
                    *da.source("cuda", which),
                    [
                        ("T", t),
                        ("D", 128),
                        ("HQ", hq),
                        ("HKV", hkv),
                        ("BLOCK_SIZE", 32),
                        ("DIRECT", direct),
                        ("OT", ot),
                        ("BF16", t == "bfloat16"),
                    ],
                )
        for d, write in itertools.product((32, 128) if wide else (128,), (False, True)):
            extra = [("pool", t), ("slots", "int32")] if write else []
            yield (
                f"qk_norm_rope-{t}-{d}-{'write' if write else 'plain'}",
                [
                    ("qkv", t),
                    ("q_weight", t),
                    ("k_weight", t),
                    ("positions", "int32"),
                    ("cos_sin", "float32"),
                    ("eps", "float32"),
                    *extra,
                ],
                [("q_out", t), ("kv_out", t)],
                qr.source("cuda", write),
                "",
                [("T", t), ("D", d), ("HQ", 16), ("HKV", 8)],
            )
        yield (
            f"add_rms_norm-{t}",
            [("x", t), ("r", t), ("weight", t), ("eps", "float32")],
            [("h_out", t), ("y_out", t)],
            an._CUDA,
            "",
            [("T", t), ("H", 5120)],
        )
        if wide:
            yield (
                "merge",
                [("o_part", "float32"), ("ml", "float32")],
                [("out", t)],
                *da.source("cuda", "merge"),  # as _kernel builds it: the warp reductions
                [("T", t)],
            )
            yield ("swiglu", [("gate_up", t)], [("out", t)], sw._CUDA, "", [("T", t)])


CASES = list(cases())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cuda_source_compiles(case):
    name, ins, outs, body, header, template = case
    rc, log = nvrtc.compile_log(nvrtc.source("k", ins, outs, body, header, template), name)
    assert rc == 0, log


def test_a_broken_source_fails():
    src = nvrtc.source("k", [("x", "float32")], [("out", "float32")], "float m = -inf;", "", [])
    rc, log = nvrtc.compile_log(src)
    assert rc != 0 and "inf" in log
