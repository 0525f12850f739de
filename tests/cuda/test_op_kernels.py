"""rms_norm, qk_norm_rope, silu_and_mul, the q8_0 and affine matmuls and the sampler noise: each
Triton op against its torch reference, and the references against float64 numpy (the quantized
ones against kipp_core.quant's dequantizers). Outputs are born NaN (deterministic mode fills
torch.empty), so an op that leaves an element unwritten fails. On CPU the kernels run under
TRITON_INTERPRET=1 at small, awkward shapes; the tests marked gpu run Qwen3 shapes on CUDA."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

from kipp_core import sampling as S
from kipp_core.quant import dequantize_affine, dequantize_q8_0, quantize_affine, quantize_q8_0
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import bench
from kipp_cuda.kernels import noise as nz
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels import qk_norm_rope as qr
from kipp_cuda.kernels import rms_norm as rn
from kipp_cuda.kernels import swiglu as sw
from oracle.qwen3 import rope_cos_sin

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (Qwen3 shapes)")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["f32", "f16", "bf16"]
# Op vs ref: the same arithmetic up to reduction order, except that the CPU interpreter rounds
# float32 -> bfloat16 toward zero (1 ulp); each output is rounded to the dtype at most twice.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty returns NaN-filled floats (and max ints) inside this block."""
    was = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def run(op, *args, **kw):
    with poisoned_empty():
        out = op(*args, **kw)
    for t in out if isinstance(out, tuple) else (out,):
        assert torch.isfinite(t).all(), "an output element was left unwritten"
    return out


def close(got, want, dtype, scale=None):
    """Elementwise within TOL[dtype] relative, plus TOL * scale absolute (scale defaults to the
    largest |want|, for outputs that are sums with cancellation)."""
    got, want = got.double().cpu(), want.double().cpu()
    tol = TOL[dtype]
    s = want.abs().max().item() if scale is None else scale
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(s, 1e-30))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype).to(DEV)


def test_public_ops_are_dispatched_with_raw_ops_importable():
    for public, raw, ref in [(rn.rms_norm, rn._rms_norm_op, rn.rms_norm_ref),
                             (qr.qk_norm_rope, qr._qk_norm_rope_op, qr.qk_norm_rope_ref),
                             (sw.silu_and_mul, sw._silu_and_mul_op, sw.silu_and_mul_ref),
                             (qm.q8_0_matmul, qm._q8_0_matmul_op, qm.q8_0_matmul_ref),
                             (am.affine_matmul, am._affine_matmul_op, am.affine_matmul_ref),
                             (nz.uniform_rows, nz._uniform_rows_op, nz.uniform_rows_ref)]:
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


def test_rope_cache_matches_the_oracle():
    got = qr.rope_cos_sin_cache(5000, 128, 1e6, "cpu")
    cos, sin = rope_cos_sin(np.arange(5000), 128, 1e6, np.float32)
    np.testing.assert_array_equal(got[:, :64].numpy(), cos[:, :64])
    np.testing.assert_array_equal(got[:, 64:].numpy(), sin[:, :64])
    assert got.dtype == torch.float32


def qk_norm_rope_f64(qkv, qw, kw, pos, hq, hkv, d, eps, theta):
    """Independent: float64 per-head RMSNorm and half-split RoPE, with the oracle's float32 cos
    and sin (the angles themselves are float32 by definition, as in transformers)."""
    cos, sin = (torch.from_numpy(a.astype(np.float64))
                for a in rope_cos_sin(pos.cpu().numpy(), d, theta, np.float32))
    x = qkv.double().cpu()
    outs = []
    for lo, n, w in ((0, hq, qw), (hq, hkv, kw)):
        h = x[:, lo * d:(lo + n) * d].reshape(-1, n, d)
        h = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps) * w.double().cpu()
        rot = torch.cat([-h[..., d // 2:], h[..., :d // 2]], dim=-1)
        outs.append(h * cos[:, None] + rot * sin[:, None])
    return outs


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,hq,hkv,d", [(1, 5, 2, 16), (6, 16, 8, 128)])
def test_qk_norm_rope(dtype, T, hq, hkv, d):
    qkv = randn(T, (hq + 2 * hkv) * d, dtype=dtype, seed=6, scale=4.0)
    qw = randn(d, dtype=dtype, seed=7)
    kw = randn(d, dtype=dtype, seed=8)
    pos = torch.randint(0, 4000, (T,), generator=gen(9)).to(DEV)
    cs = qr.rope_cos_sin_cache(4000, d, 1e6, DEV)
    q, k = run(qr._qk_norm_rope_op, qkv, qw, kw, pos, cs, hq, hkv, d, 1e-6)
    rq, rk = qr.qk_norm_rope_ref(qkv, qw, kw, pos, cs, hq, hkv, d, 1e-6)
    assert q.shape == (T, hq, d) and k.shape == (T, hkv, d) and q.is_contiguous()
    close(q, rq, dtype, scale=1.0)
    close(k, rk, dtype, scale=1.0)
    fq, fk = qk_norm_rope_f64(qkv, qw, kw, pos, hq, hkv, d, 1e-6, 1e6)
    close(rq, fq, dtype, scale=1.0)
    close(rk, fk, dtype, scale=1.0)


def test_qk_norm_rope_reads_a_strided_qkv_and_leaves_it_alone():
    T, hq, hkv, d = 3, 4, 2, 32
    big = randn(T, 2 * (hq + 2 * hkv) * d, seed=10)
    qkv = big[:, : (hq + 2 * hkv) * d]  # a row stride wider than the row
    before = qkv.clone()
    cs = qr.rope_cos_sin_cache(64, d, 1e4, DEV)
    pos = torch.tensor([0, 63, 7], device=DEV)
    args = (qkv, randn(d, seed=11), randn(d, seed=12), pos, cs, hq, hkv, d, 1e-6)
    q, k = run(qr._qk_norm_rope_op, *args)
    rq, rk = qr.qk_norm_rope_ref(*args)
    close(q, rq, torch.float32, scale=1.0)
    close(k, rk, torch.float32, scale=1.0)
    assert torch.equal(qkv, before)
    # Position 0 is the identity rotation: q is just the normed head.
    h = qkv[0, :d].double()
    normed = h / torch.sqrt((h * h).mean() + 1e-6) * args[1].double()
    close(q[0, 0], normed, torch.float32, scale=1.0)


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


# -- q8_0 matmul --------------------------------------------------------------------------------


def q8_weights(N, K, seed):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    qs, d = quantize_q8_0(w)
    return (torch.from_numpy(qs).to(DEV), torch.from_numpy(d).to(DEV),
            torch.from_numpy(dequantize_q8_0(qs, d).astype(np.float64)))


# T = 1 takes the GEMV (uneven group blocks; split-K where N is small), T in 2..16 the 16-row
# tl.dot path with split-K, larger T the prefill tiles (an uneven K block at K = 352).
Q8_CASES = [(1, 781, 1856), (1, 5, 4096), (3, 40, 2048), (16, 70, 96), (37, 130, 352)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,N,K", Q8_CASES)
def test_q8_0_matmul(dtype, T, N, K):
    qs, d, w64 = q8_weights(N, K, seed=T + N)
    x = randn(T, K, dtype=dtype, seed=14)
    out = run(qm._q8_0_matmul_op, x, qs, d)
    assert out.shape == (T, N) and out.dtype == dtype
    want = x.double().cpu() @ w64.T
    close(out, want, dtype)
    close(qm.q8_0_matmul_ref(x, qs, d), want, dtype)


def test_q8_0_split_k_is_deterministic_and_rearms_its_counters():
    qs, d, w64 = q8_weights(5, 4096, seed=3)
    x = randn(1, 4096, seed=15)
    assert qm.gemv_config(5, 128, torch.device(DEV))["SPLIT_K"] > 1
    first = run(qm._q8_0_matmul_op, x, qs, d)
    for _ in range(2):
        assert torch.equal(run(qm._q8_0_matmul_op, x, qs, d), first)
    close(first, x.double().cpu() @ w64.T, torch.float32)


def test_q8_0_embedding():
    qs, d, w64 = q8_weights(50, 96, seed=4)
    ids = torch.tensor([0, 49, 7, 7], device=DEV)
    got = qm.q8_0_embedding(ids, qs, d)
    assert torch.equal(got.double().cpu(), w64[ids.cpu()])


def test_q8_0_rejects_bad_operands():
    qs, d, _ = q8_weights(4, 64, seed=5)
    with pytest.raises(ValueError, match="K"):
        qm.q8_0_matmul(randn(1, 32), qs, d)
    with pytest.raises(ValueError, match="float16"):
        qm.q8_0_matmul(randn(1, 64), qs, d.float())


# -- affine matmul ------------------------------------------------------------------------------


def affine_weights(N, K, bits, gs, seed, sdtype):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    packed, s, b = quantize_affine(w, bits, gs)
    assert (s < 0).any()  # MLX's algorithm makes negative scales; they must work
    s_t = torch.from_numpy(s).to(sdtype)
    b_t = torch.from_numpy(b).to(sdtype)
    w64 = dequantize_affine(packed, s_t.double().numpy(), b_t.double().numpy(), bits, gs)
    wq = torch.from_numpy(packed.view(np.int32))
    return wq.to(DEV), s_t.to(DEV), b_t.to(DEV), torch.from_numpy(w64.astype(np.float64))


AFFINE_CASES = [(1, 4, 32, 781, 1856), (1, 8, 32, 5, 4096), (1, 4, 128, 37, 1024),
                (5, 8, 64, 45, 512), (16, 4, 32, 40, 2048), (37, 4, 32, 130, 352),
                (20, 8, 128, 70, 512)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,bits,gs,N,K", AFFINE_CASES)
def test_affine_matmul(dtype, T, bits, gs, N, K):
    wq, s, b, w64 = affine_weights(N, K, bits, gs, seed=T + N + bits, sdtype=dtype)
    x = randn(T, K, dtype=dtype, seed=16)
    out = run(am._affine_matmul_op, x, wq, s, b, bits, gs)
    assert out.shape == (T, N) and out.dtype == dtype
    want = x.double().cpu() @ w64.T
    close(out, want, dtype)
    close(am.affine_matmul_ref(x, wq, s, b, bits, gs), want, dtype)


def test_affine_takes_uint32_words_and_any_float_scales():
    wq, s, b, w64 = affine_weights(9, 256, 4, 32, seed=6, sdtype=torch.float32)
    x = randn(1, 256, dtype=torch.bfloat16, seed=17)
    out = run(am._affine_matmul_op, x, wq.view(torch.uint32), s, b, 4, 32)
    close(out, x.double().cpu() @ w64.T, torch.bfloat16)


def test_affine_embedding():
    wq, s, b, w64 = affine_weights(20, 128, 4, 32, seed=7, sdtype=torch.float32)
    ids = torch.tensor([19, 0, 3], device=DEV)
    got = am.affine_embedding(ids, wq, s, b, 4, 32)
    torch.testing.assert_close(got.double().cpu(), w64[ids.cpu()], rtol=1e-6, atol=1e-6)


def test_affine_rejects_bad_operands():
    wq, s, b, _ = affine_weights(4, 64, 4, 32, seed=8, sdtype=torch.float32)
    with pytest.raises(ValueError, match="bits"):
        am.affine_matmul(randn(1, 64), wq, s, b, 3, 32)
    with pytest.raises(ValueError, match="wq"):
        am.affine_matmul(randn(1, 128), wq, s, b, 4, 32)


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
        return [{"name": "fake_op", "shape": "n=1", "fn": self.fn, "ref": lambda: None,
                 "bytes": 4e9, "flops": 2e12}]


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
    (row,) = bench.bench_rows([_FakeModule(lambda: report_fallback("cuda", "fake_op", "test"))],
                              ceil, timer=lambda fn: fn() or 1.0)
    assert "fell back" in row["refused"] and "ms" not in row
    clear_fallbacks()
    monkeypatch.setenv("KIPP_CUDA_DISABLE_KERNELS", "fake_op")
    (row,) = bench.bench_rows([_FakeModule(lambda: None)], ceil, timer=lambda fn: 1.0)
    assert "DISABLE" in row["refused"]
    assert "refused" in bench.markdown([row])


def test_bench_specs_are_collected_from_every_kernel_module():
    names = {m.__name__.rsplit(".", 1)[1] for m in bench.spec_modules()}
    assert {"rms_norm", "qk_norm_rope", "swiglu", "noise", "q8_0_matmul", "affine_matmul",
            "top_p"} <= names
    shapes = bench.linear_shapes()
    assert shapes["8B"] == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096),
                            "down": (4096, 12288)}


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
@pytest.mark.parametrize("proj", ["qkv", "o", "gate_up", "down"])
def test_gpu_quantized_matmuls_at_8b_shapes(proj):
    N, K = bench.linear_shapes()["8B"][proj]
    w = (torch.randn(N, K, generator=gen(26)) * 0.02).numpy()
    qs, d = (torch.from_numpy(a).to(DEV) for a in quantize_q8_0(w))
    affine = {}
    for bits in (4, 8):
        packed, s, b = quantize_affine(w, bits, 32)
        affine[bits] = (torch.from_numpy(packed.view(np.int32)).to(DEV),
                        torch.from_numpy(s).to(DEV, torch.bfloat16),
                        torch.from_numpy(b).to(DEV, torch.bfloat16), bits, 32)
    for T in (1, 2, 16, 17, 256, 2048):  # GEMV, 16-row split-K dots, prefill tiles
        x = randn(T, K, dtype=torch.bfloat16, seed=T)
        close(run(qm.q8_0_matmul, x, qs, d), qm.q8_0_matmul_ref(x, qs, d), torch.bfloat16)
        for args in affine.values():
            close(run(am.affine_matmul, x, *args), am.affine_matmul_ref(x, *args),
                  torch.bfloat16)


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


@pytest.mark.parametrize("N,K", [(1, 64), (37, 300), (1024, 96), (130, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_gemv(N, K, dtype):
    from kipp_cuda.kernels.dense_gemv import _dense_gemv_op

    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(1, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g).to(dtype)
    got = _dense_gemv_op(x, w).float()
    ref = (x.double() @ w.double().T).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, ref, rtol=tol, atol=tol * K**0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("N,K", [(4096, 1024), (1024, 3072), (24576, 4096), (151936, 1024)])
def test_gpu_dense_gemv_qwen3_shapes(N, K):
    from kipp_cuda.kernels.dense_gemv import _dense_gemv_op

    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ w.double().T
    err = (_dense_gemv_op(x, w).double() - ref).norm() / ref.norm()
    assert err < 5e-3
