"""Weight-only quantized (q8_0, affine) and dense one-token matmuls against their references and
kipp_core.quant, on awkward shapes (CPU interpreter) and 8B shapes (GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kipp_core.quant import dequantize_affine, dequantize_q8_0, quantize_affine, quantize_q8_0
from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import bench
from kipp_cuda.kernels import q8_0_gemv as qg
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels import swiglu as sw
from kipp_cuda.kernels.matmul_tiles import int_x
from tests.cuda.kernel_testing import (
    DEV,
    DTYPE_IDS,
    HAS_CUDA,
    cases,
    close,
    gen,
    randn,
    run,
    skip_unless_runnable,
)

skip_unless_runnable()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (Qwen3 shapes)")

# -- q8_0 matmul --------------------------------------------------------------------------------


def q8_weights(N, K, seed):
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    qs, d = quantize_q8_0(w)
    return (
        torch.from_numpy(qs).to(DEV),
        torch.from_numpy(d).to(DEV),
        torch.from_numpy(dequantize_q8_0(qs, d).astype(np.float64)),
    )


# T = 1 takes the GEMV (uneven group blocks; split-K where N is small), T in 2..16 the 16-row
# tl.dot path with split-K, larger T the prefill tiles (an uneven K block at K = 352).
Q8_CASES = [(1, 781, 1856), (1, 5, 4096), (3, 40, 2048), (16, 70, 96), (37, 130, 352)]


# every shape with every dtype on a GPU; interpreted, every shape and every dtype once
@pytest.mark.parametrize(
    "case, dtype", cases(1, case={"-".join(map(str, c)): c for c in Q8_CASES}, dtype=DTYPE_IDS)
)
def test_q8_0_matmul(case, dtype):
    T, N, K = case
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
    assert qg.gemv_config(5, 128, torch.device(DEV))["SPLIT_K"] > 1
    first = run(qm._q8_0_matmul_op, x, qs, d)
    for _ in range(2):
        assert torch.equal(run(qm._q8_0_matmul_op, x, qs, d), first)
    close(first, x.double().cpu() @ w64.T, torch.float32)


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


AFFINE_CASES = [
    (1, 4, 32, 781, 1856),
    (1, 8, 32, 5, 4096),
    (1, 4, 128, 37, 1024),
    (5, 8, 64, 45, 512),
    (16, 4, 32, 40, 2048),
    (37, 4, 32, 130, 352),
    (20, 8, 128, 70, 512),
]


@pytest.mark.parametrize(  # as test_q8_0_matmul
    "case, dtype", cases(1, case={"-".join(map(str, c)): c for c in AFFINE_CASES}, dtype=DTYPE_IDS)
)
def test_affine_matmul(case, dtype):
    T, bits, gs, N, K = case
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


def test_affine_rejects_bad_operands():
    wq, s, b, _ = affine_weights(4, 64, 4, 32, seed=8, sdtype=torch.float32)
    with pytest.raises(ValueError, match="bits"):
        am.affine_matmul(randn(1, 64), wq, s, b, 3, 32)
    with pytest.raises(ValueError, match="wq"):
        am.affine_matmul(randn(1, 128), wq, s, b, 4, 32)


@gpu
@pytest.mark.parametrize("proj", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("int16_x", ["0", "1"])
def test_gpu_quantized_matmuls_at_8b_shapes(proj, int16_x, monkeypatch):
    monkeypatch.setenv("KIPP_CUDA_INT_X", int16_x)  # T = 1: the exact path, then int16 x
    N, K = bench.linear_shapes()["8B"][proj]
    w = (torch.randn(N, K, generator=gen(26)) * 0.02).numpy()
    qs, d = (torch.from_numpy(a).to(DEV) for a in quantize_q8_0(w))
    affine = {}
    for bits in (4, 8):
        packed, s, b = quantize_affine(w, bits, 32)
        affine[bits] = (
            torch.from_numpy(packed.view(np.int32)).to(DEV),
            torch.from_numpy(s).to(DEV, torch.bfloat16),
            torch.from_numpy(b).to(DEV, torch.bfloat16),
            bits,
            32,
        )
    for T in (1, 2, 16, 17, 256, 2048):  # GEMV, 16-row split-K dots, prefill tiles
        x = randn(T, K, dtype=torch.bfloat16, seed=T)
        close(run(qm.q8_0_matmul, x, qs, d), qm.q8_0_matmul_ref(x, qs, d), torch.bfloat16)
        for args in affine.values():
            close(run(am.affine_matmul, x, *args), am.affine_matmul_ref(x, *args), torch.bfloat16)
    if proj == "gate_up":  # the decode step's SwiGLU epilogue, in the tuned config of the shape
        x = randn(1, K, dtype=torch.bfloat16, seed=1)
        want = sw._silu_and_mul_op(qm.q8_0_matmul(x, qs, d))
        assert torch.equal(run(qm.q8_0_matmul, x, qs, d, swiglu=True), want)
        for args in affine.values():
            want = sw._silu_and_mul_op(am.affine_matmul(x, *args))
            assert torch.equal(run(am.affine_matmul, x, *args, swiglu=True), want)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(BLOCK_N=8, BLOCK_G=4, SPLIT_K=1, num_warps=4, PREFETCH=False),
        dict(BLOCK_N=4, BLOCK_G=8, SPLIT_K=3, num_warps=4, PREFETCH=False),
        dict(BLOCK_N=16, BLOCK_G=2, SPLIT_K=2, num_warps=4, PREFETCH=True),
        dict(BLOCK_N=8, BLOCK_G=4, SPLIT_K=1, num_warps=4, PREFETCH=2),
        dict(BLOCK_N=4, BLOCK_G=64, SPLIT_K=1, num_warps=4, PREFETCH=2),
        dict(BLOCK_N=4, BLOCK_G=8, SPLIT_K=3, num_warps=4, PREFETCH=2),
    ],
    ids=["one-tile", "one-tile-split3", "prefetch-split2", "early", "early-one-step", "early-3"],
)
def test_quantized_gemv_launch_options(cfg):
    """The tuned table's launch options (PREFETCH off: one tile in flight a program; 2: its first
    tile before the PDL wait) on masked rows, a K split that leaves a short last split, groups
    that do not fill a K step, and (early-one-step) all of K in one step."""
    N, K = 37, 1216  # 38 groups
    qs, d, w64 = q8_weights(N, K, seed=12)
    x = randn(1, K, dtype=torch.bfloat16, seed=13)
    if cfg["PREFETCH"] != 2:  # (affine only)
        close(run(qg.q8_0_gemv, x, qs, d, cfg), x.double().cpu() @ w64.T, torch.bfloat16)
    for bits in (4, 8):
        wq, s, b, w64 = affine_weights(N, K, bits, 32, seed=14, sdtype=torch.bfloat16)
        close(
            run(ag.affine_gemv, x, wq, s, b, bits, 32, cfg),
            x.double().cpu() @ w64.T,
            torch.bfloat16,
        )


def int16_x_bound(x, w64):
    """|error| per output of the int16-x GEMV path against exact sums of its inputs: each value
    of x is off by at most half its group's step max|x_g| / 32767, times |w| summed over the
    group, plus fp32 rounding of the group sums."""
    xg = x.double().cpu().reshape(-1, 32)
    half_step = xg.abs().amax(dim=1) / 32767 / 2  # [groups]
    wg = w64.abs().reshape(w64.shape[0], -1, 32).sum(-1)  # [N, groups]
    exact = x.double().cpu() @ w64.T
    return exact, (wg * half_step).sum(-1) * 1.001 + 1e-6 * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_quantized_gemv_int16_x_error_within_its_bound(dtype):
    """bf16/fp16 x takes the int16-x path (x ~ xs q per group of 32, dp2a on the weights'
    integers): within the bound of x's rounding, with an outlier that coarsens one group's step.
    The exact fp32 path (INT_X off) stays within fp32 rounding of the same sums."""
    N, K = 37, 1216
    qs, d, w64 = q8_weights(N, K, seed=21)
    x = randn(1, K, dtype=dtype, seed=22)
    x[0, 40] = 50.0
    cfg = dict(BLOCK_N=8, BLOCK_G=8, SPLIT_K=1, num_warps=4, PREFETCH=False, INT_X=True)
    exact, bound = int16_x_bound(x, w64)
    got = run(qg.q8_0_gemv, x, qs, d, cfg, f32(N)).double().cpu()[0]
    assert ((got - exact[0]).abs() <= bound).all()
    assert (got - exact[0]).abs().max() > 1e-3 * bound.max()  # the path did quantize x
    off = run(qg.q8_0_gemv, x, qs, d, {**cfg, "INT_X": False}, f32(N)).double().cpu()[0]
    same_sums(off, exact[0])
    for bits in (4, 8):
        wq, s, b, w64 = affine_weights(N, K, bits, 32, seed=23, sdtype=dtype)
        exact, bound = int16_x_bound(x, w64)
        got = run(ag.affine_gemv, x, wq, s, b, bits, 32, cfg, f32(N)).double().cpu()[0]
        assert ((got - exact[0]).abs() <= bound).all(), bits


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's inf * 0
def test_quantized_gemv_int16_x_passes_nan_and_inf_on():
    """A NaN or inf in x must not vanish into an int16 zero: every output becomes NaN."""
    N, K = 9, 256
    qs, d, _ = q8_weights(N, K, seed=24)
    wq, s, b, _ = affine_weights(N, K, 4, 32, seed=25, sdtype=torch.bfloat16)
    cfg = dict(BLOCK_N=4, BLOCK_G=8, SPLIT_K=1, num_warps=4, INT_X=True)
    for bad in (float("nan"), float("inf")):
        x = randn(1, K, dtype=torch.bfloat16, seed=26)
        x[0, 77] = bad
        assert qg.q8_0_gemv(x, qs, d, cfg).isnan().all()
        assert ag.affine_gemv(x, wq, s, b, 4, 32, cfg).isnan().all()


def test_int_x_is_chosen_by_config_or_environment(monkeypatch):
    """Off unless the config (the tuned table) or KIPP_CUDA_INT_X turns it on; never for fp32 x."""
    bf16, fp32 = torch.bfloat16, torch.float32
    monkeypatch.delenv("KIPP_CUDA_INT_X", raising=False)
    assert not int_x({}, bf16) and int_x({"INT_X": True}, bf16)
    assert not int_x({"INT_X": True}, fp32)
    monkeypatch.setenv("KIPP_CUDA_INT_X", "1")
    assert int_x({}, bf16) and int_x({"INT_X": False}, torch.float16) and not int_x({}, fp32)
    monkeypatch.setenv("KIPP_CUDA_INT_X", "0")
    assert not int_x({"INT_X": True}, bf16)


def test_quantized_gemv_takes_unaligned_views():
    """The GEMVs read x and the weight rows 16 bytes at a time: views that start off that
    alignment (a 2-byte offset into x, a 1-byte offset into qs, a word into wq) are copied, not
    misread."""
    N, K = 13, 128
    qs, d, _ = q8_weights(N, K, seed=9)
    x = randn(1, K + 1, dtype=torch.bfloat16, seed=10)[:, 1:]
    assert x.data_ptr() % 8
    qs_view = torch.zeros(N * K + 1, dtype=torch.int8, device=DEV)[1:].view(N, K)
    qs_view.copy_(qs)
    want = qm.q8_0_matmul_ref(x, qs, d)
    close(run(qg.q8_0_gemv, x, qs_view, d), want, torch.bfloat16)
    wq, s, b, _ = affine_weights(N, K, 4, 32, seed=11, sdtype=torch.bfloat16)
    wq_view = torch.zeros(N * K // 8 + 1, dtype=torch.int32, device=DEV)[1:].view(N, K // 8)
    wq_view.copy_(wq)
    close(
        run(ag.affine_gemv, x, wq_view, s, b, 4, 32),
        am.affine_matmul_ref(x, wq, s, b, 4, 32),
        torch.bfloat16,
    )


def same_sums(a, b):
    # fp32 sums of the same terms in another order: within ~100 ulp of the largest output (a
    # wrong term is off by the size of a term)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def f32(N):
    return torch.empty((1, N), dtype=torch.float32, device=DEV)


@gpu
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_gpu_quantized_gemv_lop3_path_equals_integer_path(dtype):
    """bits.py's inline PTX (16-byte vector loads; shift + LOP3 into the float bits; dp2a on
    int16 x) against its plain path (tl.load, integer ops) in the same kernels on the GPU: the
    same exact values, so the same sums up to their order (the two paths' layouts reduce a row's
    groups in different trees, which fp32 x rounds). Odd shapes (masked rows and groups,
    split-K), the 8B down shape, fp32, bf16 and fp16 x, group sizes 32 and 128, INT_X off and
    on."""
    for N, K, split in ((781, 1920, 1), (5, 4096, 4), (4096, 12288, 2)):
        w = (torch.randn(N, K, generator=gen(N)) * 0.02).numpy()
        qs, d = (torch.from_numpy(a).to(DEV) for a in quantize_q8_0(w))
        x = randn(1, K, dtype=dtype, seed=K)
        for on in (False, True):  # the exact fp32 path, then int16 x with dp2a
            cfg = dict(BLOCK_N=8, BLOCK_G=16, SPLIT_K=split, num_warps=4, INT_X=on)
            # fp32 outputs whatever x is: the sums before any rounding to x's dtype
            fast, plain = (qg.q8_0_gemv(x, qs, d, cfg, out=f32(N), asm=a) for a in (True, False))
            same_sums(fast, plain)
            close(fast, qm.q8_0_matmul_ref(x, qs, d), dtype)
            for bits, gs in ((4, 32), (8, 32), (4, 128)):
                packed, s, b = quantize_affine(w, bits, gs)
                args = (
                    torch.from_numpy(packed.view(np.int32)).to(DEV),
                    torch.from_numpy(s).to(DEV, torch.bfloat16),
                    torch.from_numpy(b).to(DEV, torch.bfloat16),
                    bits,
                    gs,
                )
                fast, plain = (
                    ag.affine_gemv(x, *args, cfg, out=f32(N), asm=a) for a in (True, False)
                )
                same_sums(fast, plain)
                close(fast, am.affine_matmul_ref(x, *args), dtype)


@pytest.mark.parametrize("N,K", [(1, 64), (37, 300), (1024, 96), (130, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_gemv(N, K, dtype):
    from kipp_cuda.kernels.dense_gemv import _dense_gemv_op

    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(1, K, generator=g).to(dtype).to(DEV)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEV)
    got = run(_dense_gemv_op, x, w).float()
    ref = (x.double() @ w.double().T).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, ref, rtol=tol, atol=tol * K**0.5)


@pytest.mark.parametrize(
    "config",
    [
        None,
        dict(BLOCK_N=4, BLOCK_K=32, SPLIT_K=3, num_warps=4),
        dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=2, num_warps=2),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_gemv_split_k_and_fused_swiglu(config, dtype):
    """Split-K partials summed in a fixed order, and act=True: silu(gate) * up rounded to the
    dtype (as silu_and_mul rounds it), then the GEMV; against float64 from the same rounded
    activation, and deterministic across calls."""
    from kipp_cuda.kernels.dense_gemv import _dense_gemv_op, dense_gemv_ref
    from kipp_cuda.kernels.swiglu import silu_and_mul_ref

    g = torch.Generator().manual_seed(5)
    N, K = 37, 200
    gu = (torch.randn(1, 2 * K, generator=g) * 3).to(dtype).to(DEV)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEV)
    got = run(_dense_gemv_op, gu, w, True, config)
    g64, u64 = gu.double().chunk(2, dim=-1)
    act64 = g64 * torch.sigmoid(g64) * u64  # float64, unrounded
    ref = act64 @ w.double().T
    # bf16 rounds the activation (and the output): allow that rounding on every term.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    atol = tol * ((act64 * w.double()) ** 2).sum(-1).sqrt().max().item()
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=atol)
    torch.testing.assert_close(dense_gemv_ref(gu, w, True).double(), ref, rtol=tol, atol=atol)
    assert torch.equal(got, _dense_gemv_op(gu, w, True, config))
    act = silu_and_mul_ref(gu)
    plain = run(_dense_gemv_op, act, w, False, config)
    torch.testing.assert_close(plain.double(), act.double() @ w.double().T, rtol=tol, atol=atol)
    with pytest.raises(ValueError, match="dense_gemv"):
        _dense_gemv_op(act, w, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("N,K", [(4096, 1024), (1024, 3072), (24576, 4096), (151936, 1024)])
def test_gpu_dense_gemv_qwen3_shapes(N, K):
    from kipp_cuda.kernels.dense_gemv import _dense_gemv_op

    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ w.double().T
    err = (_dense_gemv_op(x, w).double() - ref).norm() / ref.norm()
    assert err < 5e-3
