"""The MLX custom kernels against their references, where MLX runs on a GPU (Metal, or MLX's CUDA
build): awkward shapes in every dtype, and every kernel's probe at every registry shape with
kernels required. Skipped, saying why, where MLX runs on the CPU."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kipp_core import fastpath
from kipp_core.registry import REGISTRY
from kipp_mlx.kernels import add_rms_norm as an
from kipp_mlx.kernels import affine_gemv as ag
from kipp_mlx.kernels import decode_attention as da
from kipp_mlx.kernels import ladder
from kipp_mlx.kernels import qk_norm_rope as qr
from kipp_mlx.kernels import swiglu as sw

pytestmark = pytest.mark.skipif(
    ladder.gpu_kind() is None,
    reason="custom kernels need MLX on Metal or CUDA; this MLX runs on the CPU",
)
DTYPES = [mx.float32, mx.bfloat16, mx.float16]


def kind():
    return ladder.gpu_kind()


def close(got, want, dtype):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    atol, rtol = ladder.tolerance(dtype)
    for g, w in zip(got, want):
        np.testing.assert_allclose(
            np.array(g.astype(mx.float32)), np.array(w.astype(mx.float32)), atol=atol, rtol=rtol
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,lens",
    [
        ((8, 2, 128, 32), (1, 35, 287)),
        ((16, 8, 64, 16), (5000,)),
        ((32, 8, 128, 32), (1, 2048, 100, 700)),
        ((64, 8, 128, 32), (33,)),
        ((5, 5, 32, 3), (7, 1, 40)),
    ],
)
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("mma", [None, False])  # the tensor-core kernel where it applies; scalar
def test_decode_attention_matches_ref(dtype, shape, lens, splits, mma):
    args = da.probe_inputs(*shape, dtype, seed=7, lens=lens)
    got = da.decode_attention(*args, kind=kind(), max_context=max(lens), splits=splits, mma=mma)
    close(got, da.decode_attention_ref(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 2, 32), (40, 8, 128)])
def test_qk_norm_rope_matches_ref(dtype, heads, kv_heads, head_dim):
    args = qr.probe_inputs(heads, kv_heads, head_dim, dtype, seed=3)
    close(qr.qk_norm_rope(*args, kind=kind()), qr.qk_norm_rope_ref(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 8, 128), (4, 2, 32), (40, 8, 128)])
def test_qk_norm_rope_write_matches_ref_and_writes_in_place(dtype, heads, kv_heads, head_dim):
    """q, kv and the pool equal the reference's (qk_norm_rope + MLX's scatter); evaluating the
    returned pool alone runs the write (a prefill chunk that samples nothing reads only its
    pools), and the pool array passed in holds the new rows afterwards: written in place."""
    args = qr.write_probe_inputs(heads, kv_heads, head_dim, dtype, seed=3)
    pool, slots = args[-2], args[-1]
    before = np.array(pool.astype(mx.float32))
    got = qr.qk_norm_rope_write(*args, kind=kind())
    mx.eval(got[2])  # q and kv not asked for
    written = np.array(pool.astype(mx.float32))
    want = qr.qk_norm_rope_write_ref(*qr.write_probe_inputs(heads, kv_heads, head_dim, dtype, 3))
    close(got, want, dtype)
    np.testing.assert_array_equal(written, np.array(got[2].astype(mx.float32)))
    after = np.array(pool.astype(mx.float32))
    idx = np.array(slots)
    np.testing.assert_array_equal(np.delete(after, idx, 0), np.delete(before, idx, 0))
    close(mx.array(after[idx]), got[1], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 1024, 5120])
def test_add_rms_norm_matches_ref(dtype, hidden):
    args = an.probe_inputs(hidden, dtype, seed=hidden)
    close(an.add_rms_norm(*args, kind=kind()), an.add_rms_norm_ref(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_matches_ref(dtype):
    args = sw.probe_inputs(dtype, seed=1)
    close(sw.swiglu(*args, kind=kind()), sw.swiglu_ref(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(300, 3072), (33, 12288)])  # 0.6B and 8B widths
def test_swiglu_at_registry_widths(dtype, rows, inter):
    x = np.random.default_rng(rows).standard_normal((rows, 2 * inter)).astype(np.float32) * 3
    gate_up = mx.array(x).astype(dtype)
    close(sw.swiglu(gate_up, kind=kind()), sw.swiglu_ref(gate_up), dtype)


@pytest.mark.parametrize("rows,inter", [(5, 13), (1, 3), (7, 1030)])
def test_swiglu_rows_not_a_multiple_of_eight(rows, inter):
    """A thread's 8 outputs cross into the next row when the width is not a multiple of 8."""
    x = np.random.default_rng(inter).standard_normal((rows, 2 * inter)).astype(np.float32)
    gate_up = mx.array(x).astype(mx.bfloat16)
    close(sw.swiglu(gate_up, kind=kind()), sw.swiglu_ref(gate_up), mx.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("config", [None, (1, 8), (4, 4)])
def test_affine_gemv_matches_ref(dtype, bits, rows, config):
    rng = np.random.default_rng(rows + bits)
    w = mx.array(rng.standard_normal((1823, 768)).astype(np.float32)).astype(dtype)
    q = mx.quantize(w, group_size=32, bits=bits)
    x = mx.array(rng.standard_normal((rows, 768)).astype(np.float32)).astype(dtype)
    got = ag.affine_gemv(x, *q, bits, kind=kind(), config=config)
    close(got, ag.affine_gemv_ref(x, *q, bits), dtype)


@pytest.mark.parametrize("name", sorted({e.name for e in REGISTRY.values()}))
def test_every_kernel_passes_its_probe_at_registry_shapes(name, monkeypatch):
    """With kernels required, choosing them at a registry shape in bf16 raises on any fallback."""
    monkeypatch.setenv("KIPP_MLX_REQUIRE_KERNELS", "1")
    fastpath.clear_fallbacks()
    cfg = next(e.config for e in REGISTRY.values() if e.name == name)
    k = ladder.model_kernels(cfg, 32, mx.bfloat16)
    assert k.decode_attention is not None
    assert k.qk_norm_rope is not qr.qk_norm_rope_ref and k.add_rms_norm is not an.add_rms_norm_ref
    assert k.qk_norm_rope_write is not None  # the kernel, not the scatter
    for bits in (4, 8):
        ladder.choose(
            "affine_gemv",
            lambda *a: ag.affine_gemv(*a, kind=kind()),
            ag.affine_gemv_ref,
            lambda bits=bits: ag.probe_inputs(mx.bfloat16, bits),
            *ladder.tolerance(mx.bfloat16),
        )
    assert not fastpath.fallbacks()
