"""rms_norm, qk_norm_rope, silu_and_mul and the sampler noise (matmuls: test_matmul_kernels): each
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
from kipp_cuda.kernels import kv_write as kvw
from kipp_cuda.kernels import noise as nz
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels import qk_norm_rope as qr
from kipp_cuda.kernels import rms_norm as rn
from kipp_cuda.kernels import swiglu as sw
from oracle.qwen3 import rope_cos_sin
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


def test_rope_cache_matches_the_oracle():
    got = qr.rope_cos_sin_cache(5000, 128, 1e6, "cpu")
    cos, sin = rope_cos_sin(np.arange(5000), 128, 1e6, np.float32)
    np.testing.assert_array_equal(got[:, :64].numpy(), cos[:, :64])
    np.testing.assert_array_equal(got[:, 64:].numpy(), sin[:, :64])
    assert got.dtype == torch.float32


YARN_8B = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def test_yarn_rope_cache_matches_transformers():
    # Qwen's 131k recipe for 4B-32B: transformers' own rotary embedding at positions past 32k
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf_cfg = Qwen3Config(
        head_dim=128, max_position_embeddings=131072, rope_theta=1e6, rope_scaling=dict(YARN_8B)
    )
    rot = Qwen3RotaryEmbedding(hf_cfg)
    pos = torch.tensor([[0, 1, 4095, 32767, 32768, 100000, 131071]])
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    got = qr.rope_cos_sin_cache(131072, 128, 1e6, "cpu", dict(YARN_8B))[pos[0]].double()
    # The float32 frequencies differ by up to 4 ulps (tests/oracle/test_yarn.py: torch's pow and
    # the blend's roundings; 2 seen with transformers 5.24), so the angles by angle x 4 x 2^-23;
    # then two libms' cos/sin, an ulp each, times the attention factor (1.14)
    angle = pos[0, :, None].double() * rot.inv_freq.double()
    tol = rot.attention_scaling * (4 * angle * 2**-23 + 2**-23)
    assert ((got[:, :64] - cos[0, :, :64]).abs() <= tol).all()
    assert ((got[:, 64:] - sin[0, :, :64]).abs() <= tol).all()
    assert rot.attention_scaling > 1.1 and got[0, 0] == np.float32(rot.attention_scaling)


def qk_norm_rope_f64(qkv, qw, kw, pos, hq, hkv, d, eps, theta, rope_scaling=None):
    """Independent: float64 per-head RMSNorm and half-split RoPE, with the oracle's float32 cos
    and sin (the angles themselves are float32 by definition, as in transformers)."""
    cos, sin = (
        torch.from_numpy(a.astype(np.float64))
        for a in rope_cos_sin(pos.cpu().numpy(), d, theta, np.float32, rope_scaling)
    )
    x = qkv.double().cpu()
    outs = []
    for lo, n, w in ((0, hq, qw), (hq, hkv, kw)):
        h = x[:, lo * d : (lo + n) * d].reshape(-1, n, d)
        h = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps) * w.double().cpu()
        rot = torch.cat([-h[..., d // 2 :], h[..., : d // 2]], dim=-1)
        outs.append(h * cos[:, None] + rot * sin[:, None])
    return outs


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,hq,hkv,d", [(1, 5, 2, 16), (6, 16, 8, 128)])
@pytest.mark.parametrize("yarn", [None, {**YARN_8B, "original_max_position_embeddings": 1000}])
def test_qk_norm_rope(dtype, T, hq, hkv, d, yarn):
    qkv = randn(T, (hq + 2 * hkv) * d, dtype=dtype, seed=6, scale=4.0)
    qw = randn(d, dtype=dtype, seed=7)
    kw = randn(d, dtype=dtype, seed=8)
    pos = torch.randint(0, 4000, (T,), generator=gen(9)).to(DEV)
    cs = qr.rope_cos_sin_cache(4000, d, 1e6, DEV, yarn)
    q, k = run(qr._qk_norm_rope_op, qkv, qw, kw, pos, cs, hq, hkv, d, 1e-6)
    rq, rk = qr.qk_norm_rope_ref(qkv, qw, kw, pos, cs, hq, hkv, d, 1e-6)
    assert q.shape == (T, hq, d) and k.shape == (T, hkv, d) and q.is_contiguous()
    # h1 cos - h2 sin cancels: kernel and reference may round the normed head an ulp apart (two
    # rsqrts), an error of up to 2 ulp(|h|) x the attention factor, relative to the largest |o|
    scale = None if yarn else 1.0
    close(q, rq, dtype, scale=scale)
    close(k, rk, dtype, scale=scale)
    fq, fk = qk_norm_rope_f64(qkv, qw, kw, pos, hq, hkv, d, 1e-6, 1e6, yarn)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("T,hq,hkv,d,page", [(1, 5, 2, 16, 4), (7, 16, 8, 128, 16)])
def test_qk_norm_rope_kv_write_equals_the_two_ops(dtype, T, hq, hkv, d, page):
    """The fused launch: q as qk_norm_rope gives it, and the cache exactly as kv_write leaves it
    after storing that k and qkv's v (untouched slots and skipped tokens stay as they were)."""
    qkv = randn(T, (hq + 2 * hkv) * d, dtype=dtype, seed=13, scale=4.0)
    qw, kw = randn(d, dtype=dtype, seed=14), randn(d, dtype=dtype, seed=15)
    pos = torch.randint(0, 4000, (T,), generator=gen(16)).to(DEV)
    cs = qr.rope_cos_sin_cache(4000, d, 1e6, DEV)
    num_blocks = T + 3
    slots = torch.randperm(num_blocks * page, generator=gen(17))[:T].to(DEV)
    slots[T // 2] = -1  # a padded token writes nothing
    k0 = randn(num_blocks, page, hkv, d, dtype=dtype, seed=18)
    v0 = randn(num_blocks, page, hkv, d, dtype=dtype, seed=19)
    caches = [k0.clone(), v0.clone(), k0.clone(), v0.clone()]
    args = (qkv, qw, kw, pos, cs, hq, hkv, d, 1e-6, slots)
    q = run(qr._qk_norm_rope_kv_write_op, *args, caches[0], caches[1])
    rq = qr.qk_norm_rope_kv_write_ref(*args, caches[2], caches[3])
    close(q, rq, dtype, scale=1.0)
    close(caches[0], caches[2], dtype, scale=1.0)
    assert torch.equal(caches[1], caches[3])  # v is copied, bit for bit
    # The reference is the two ops it fuses.
    k_ref, v_ref = k0.clone(), v0.clone()
    q2, k2 = qr.qk_norm_rope_ref(*args[:9])
    v2 = qkv[:, (hq + hkv) * d :].reshape(T, hkv, d)
    kvw.kv_write_ref(k2, v2, k_ref, v_ref, slots)
    assert torch.equal(rq, q2) and torch.equal(caches[2], k_ref) and torch.equal(caches[3], v_ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (Qwen3 shapes)")
@pytest.mark.parametrize("hq", [16, 32])
def test_gpu_qk_norm_rope_kv_write_qwen3_shapes(hq):
    test_qk_norm_rope_kv_write_equals_the_two_ops(torch.bfloat16, 300, hq, 8, 128, 32)


def test_qk_norm_rope_kv_write_rejects_a_quantized_or_mismatched_cache():
    qkv = randn(2, 8 * 32, seed=20)
    cs = qr.rope_cos_sin_cache(64, 32, 1e4, DEV)
    pos = torch.tensor([1, 2], device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    args = (qkv, randn(32, seed=21), randn(32, seed=22), pos, cs, 4, 2, 32, 1e-6, slots)
    bad = torch.zeros(4, 4, 2, 32, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="cache"):
        qr._qk_norm_rope_kv_write_op(*args, bad, bad.clone())
    q8 = torch.zeros(4, 4, 2, 32, dtype=torch.int8, device=DEV)
    with pytest.raises(ValueError):
        qr._qk_norm_rope_kv_write_op(*args, q8, q8.clone())


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
