"""rms_norm, block copy, silu_and_mul and the sampler noise (matmuls: test_matmul_kernels; q/k norm
and RoPE: test_qk_norm_rope): each
Triton op against its torch reference, and the references against float64 numpy (the quantized
ones against kipp_core.quant's dequantizers). Outputs are born NaN (deterministic mode fills
torch.empty), so an op that leaves an element unwritten fails. On CPU the kernels run under
TRITON_INTERPRET=1 at small, awkward shapes; the tests marked gpu run Qwen3 shapes on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kipp_core import sampling as S
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import bench
from kipp_cuda.kernels import block_copy as bc
from kipp_cuda.kernels import noise as nz
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels import qk_norm_rope as qr
from kipp_cuda.kernels import rms_norm as rn
from kipp_cuda.kernels import swiglu as sw
from tests.cuda.kernel_testing import (
    DEV,
    DTYPES,
    HAS_CUDA,
    IDS,
    close,
    gen,
    randn,
    run,
    skip_unless_runnable,
)

skip_unless_runnable()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (Qwen3 shapes)")


def test_public_ops_are_dispatched_with_raw_ops_importable():
    for public, raw, ref in [
        (rn.rms_norm, rn._rms_norm_op, rn.rms_norm_ref),
        (qr.qk_norm_rope, qr._qk_norm_rope_op, qr.qk_norm_rope_ref),
        (qr.qk_norm_rope_kv_write, qr._qk_norm_rope_kv_write_op, qr.qk_norm_rope_kv_write_ref),
        (sw.silu_and_mul, sw._silu_and_mul_op, sw.silu_and_mul_ref),
        (bc.copy_block, bc._copy_block_op, bc.copy_block_ref),
        (qm.q8_0_matmul, qm._q8_0_matmul_op, qm.q8_0_matmul_ref),
        (am.affine_matmul, am._affine_matmul_op, am.affine_matmul_ref),
        (nz.uniform_rows, nz._uniform_rows_op, nz.uniform_rows_ref),
    ]:
        assert public.op is raw and public.ref is ref


# -- rms_norm -----------------------------------------------------------------------------------


def rms_norm_f64(x, w, eps):
    x = x.double()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,H", [(1, 781), (5, 1823)])
def test_rms_norm(dtype, T, H):
    x = randn(T, H, dtype=dtype, seed=1, scale=3.0)
    w = randn(H, dtype=dtype, seed=2)
    out = run(rn._rms_norm_op, x, w, 1e-6)
    ref = rn.rms_norm_ref(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == (T, H)
    close(out, ref, dtype, scale=1.0)
    close(ref, rms_norm_f64(x, w, 1e-6), dtype, scale=1.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_with_residual(dtype):
    T, H = 3, 1031
    x = randn(T, H, dtype=dtype, seed=3)
    r = randn(T, H, dtype=dtype, seed=4, scale=10.0)
    w = randn(H, dtype=dtype, seed=5)
    out, res = run(rn._rms_norm_op, x, w, 1e-5, r)
    ref_out, ref_res = rn.rms_norm_ref(x, w, 1e-5, r)
    # The residual is the model-dtype add; the interpreter's bf16 rounding is 1 ulp off.
    if dtype == torch.bfloat16 and not HAS_CUDA:
        close(res, ref_res, dtype)
    else:
        assert torch.equal(res, ref_res)
    close(out, ref_out, dtype, scale=1.0)
    close(ref_out, rms_norm_f64(ref_res, w, 1e-5), dtype, scale=1.0)


def test_rms_norm_rejects_bad_shapes():
    x = randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        rn.rms_norm(x, randn(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rn.rms_norm(x, randn(8), 1e-6, randn(2, 8, dtype=torch.float16))


# -- qk_norm_rope -------------------------------------------------------------------------------


# -- copy_block ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, dim, dtype",
    [
        ((3, 2, 5, 4, 2, 16), 2, torch.bfloat16),  # kv_cache.allocate's [layers, 2, blocks, ...]
        ((3, 2, 5, 4, 2, 1), 2, torch.float16),  # q8_0 scales: a block of 8 elements
        ((3, 2, 5, 4, 2, 32), 2, torch.int8),  # q8_0 values
        ((6, 3, 1500), 0, torch.float32),  # blocks first; 4,500 elements: a partial chunk
    ],
)
def test_copy_block_moves_one_block_in_every_row(shape, dim, dtype):
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(shape, generator=g) * 50).to(dtype).to(DEV)
    for src, dst in ((1, 3), (4, 0), (-1, 2)):
        want = base.clone()
        if src >= 0:  # hand-derived: dst's slices become src's, nothing else changes
            want.select(dim, dst).copy_(base.select(dim, src))
        blocks = torch.tensor([src, dst], dtype=torch.int64, device=DEV)
        for fn in (bc._copy_block_op, bc.copy_block_ref):
            got = base.clone()
            fn(got, blocks, dim)
            assert torch.equal(got, want), (fn, src, dst)


def test_copy_block_rejects_bad_arguments():
    store = torch.zeros((2, 2, 4, 8), device=DEV)
    with pytest.raises(ValueError, match="block_dim"):
        bc._copy_block_op(store, torch.tensor([0, 1], device=DEV), 4)
    with pytest.raises(ValueError, match="int64"):
        bc._copy_block_op(store, torch.tensor([0, 1], dtype=torch.int32, device=DEV), 2)


# -- silu_and_mul -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,I", [(1, 781), (4, 1823)])
def test_silu_and_mul(dtype, T, I):
    x = randn(T, 2 * I, dtype=dtype, seed=13, scale=4.0)
    out = run(sw._silu_and_mul_op, x)
    ref = sw.silu_and_mul_ref(x)
    assert out.shape == (T, I) and out.dtype == dtype
    close(out, ref, dtype)
    g, u = x.double().chunk(2, dim=-1)
    close(ref, g / (1 + torch.exp(-g)) * u, dtype)


# -- noise --------------------------------------------------------------------------------------

NOISE_KEYS = [(0, 0, 0, 0), (2**64 - 1, 3, 17, 1), (-9, 1, 2**31, 0), (123456789, 7, 5, 0)]


def test_uniform_rows_equal_numpy_bit_for_bit():
    keys = [S.noise_keys(*k) for k in NOISE_KEYS]
    k1 = torch.tensor([a for a, _ in keys], device=DEV)
    k2 = torch.tensor([b for _, b in keys], device=DEV)
    n = 5003
    got = run(nz._uniform_rows_op, k1, k2, n).cpu().numpy()
    ref = nz.uniform_rows_ref(k1, k2, n).cpu().numpy()
    for row, (seed, stream, step, salt) in enumerate(NOISE_KEYS):
        want = S.uniform(seed, stream, step, n, salt)
        np.testing.assert_array_equal(got[row], want)
        np.testing.assert_array_equal(ref[row], want)


# -- bench (its logic; the timing itself needs CUDA) --------------------------------------------


class _FakeModule:
    __name__ = "fake"

    def __init__(self, fn):
        self.fn = fn

    def bench_specs(self):
        return [
            {
                "name": "fake_op",
                "shape": "n=1",
                "fn": self.fn,
                "ref": lambda: None,
                "bytes": 4e9,
                "flops": 2e12,
            }
        ]


def test_bench_rows_report_and_refuse(monkeypatch):
    from kipp_core.fastpath import clear_fallbacks, report_fallback

    ceil = {"gb_s": 4000.0, "tflop_s": 800.0}
    clear_fallbacks()
    monkeypatch.delenv("KIPP_CUDA_DISABLE_KERNELS", raising=False)
    monkeypatch.delenv("KIPP_CUDA_REQUIRE_KERNELS", raising=False)
    (row,) = bench.bench_rows([_FakeModule(lambda: None)], ceil, timer=lambda fn: 2.0)
    assert row["gb_s"] == pytest.approx(2000) and row["bw_frac"] == pytest.approx(0.5)
    assert row["tflop_s"] == pytest.approx(1000) and "refused" not in row
    assert "| fake_op | n=1 | 2.0000 |" in bench.markdown([row])
    (row,) = bench.bench_rows(
        [_FakeModule(lambda: report_fallback("cuda", "fake_op", "test"))],
        ceil,
        timer=lambda fn: fn() or 1.0,
    )
    assert "fell back" in row["refused"] and "ms" not in row
    clear_fallbacks()
    monkeypatch.setenv("KIPP_CUDA_DISABLE_KERNELS", "fake_op")
    (row,) = bench.bench_rows([_FakeModule(lambda: None)], ceil, timer=lambda fn: 1.0)
    assert "DISABLE" in row["refused"]
    assert "refused" in bench.markdown([row])


def test_bench_specs_are_collected_from_every_kernel_module():
    names = {m.__name__.rsplit(".", 1)[1] for m in bench.spec_modules()}
    assert {
        "rms_norm",
        "qk_norm_rope",
        "swiglu",
        "noise",
        "q8_0_matmul",
        "affine_matmul",
        "top_p",
    } <= names
    shapes = bench.linear_shapes()
    assert shapes["8B"] == {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (24576, 4096),
        "down": (4096, 12288),
    }


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU refusal")
def test_bench_main_refuses_without_cuda():
    assert bench.main([]) == 2


# -- Qwen3 shapes on a GPU ----------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("T", [1, 16, 2048])
def test_gpu_norms_and_activation_at_qwen3_shapes(T):
    bf = torch.bfloat16
    x = randn(T, 4096, dtype=bf, seed=20, scale=3.0)
    r = randn(T, 4096, dtype=bf, seed=21, scale=30.0)
    w = randn(4096, dtype=bf, seed=22)
    out, res = run(rn.rms_norm, x, w, 1e-6, r)
    ref_out, ref_res = rn.rms_norm_ref(x, w, 1e-6, r)
    assert torch.equal(res, ref_res)
    close(out, ref_out, bf, scale=1.0)
    qkv = randn(T, 48 * 128, dtype=bf, seed=23, scale=5.0)
    cs = qr.rope_cos_sin_cache(40960, 128, 1e6, DEV)
    pos = torch.randint(0, 40960, (T,), generator=gen(24)).to(DEV)
    args = (qkv, w[:128], w[128:256], pos, cs, 32, 8, 128, 1e-6)
    for got, want in zip(run(qr.qk_norm_rope, *args), qr.qk_norm_rope_ref(*args)):
        close(got, want, bf, scale=1.0)
    g = randn(T, 2 * 12288, dtype=bf, seed=25, scale=4.0)
    close(run(sw.silu_and_mul, g), sw.silu_and_mul_ref(g), bf)


@gpu
def test_gpu_noise_over_the_vocabulary():
    keys = [S.noise_keys(s, 0, 9, 0) for s in range(64)]
    k1 = torch.tensor([a for a, _ in keys], device=DEV)
    k2 = torch.tensor([b for _, b in keys], device=DEV)
    got = run(nz.uniform_rows, k1, k2, 151936).cpu().numpy()
    for s in (0, 31, 63):
        np.testing.assert_array_equal(got[s], S.uniform(s, 0, 9, 151936))


@gpu
def test_gpu_bench_runs_and_reports():
    rows = bench.run_kernel_bench("cuda", only="uniform_rows")
    assert rows and all("refused" not in r and r["gb_s"] > 0 for r in rows)
    assert 0 < rows[0]["ceiling_gb_s"] and 0 < rows[0]["ceiling_tflop_s"]
