"""The residual add + RMSNorm fused into the one-token GEMVs' reads of x (kernels/norm_x.py): each
GEMV kind against rms_norm_ref + its matmul reference, against rms_norm + the plain GEMV, the new
residual, the layers' forward_norm and the model at decode (CPU interpreter; 8B shapes and a CUDA
graph on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kipp_core.quant import quantize_affine, quantize_q8_0
from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import bench
from kipp_cuda.kernels import dense_gemv as dg
from kipp_cuda.kernels import q8_0_gemv as qg
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels import rms_norm as rn
from kipp_cuda.kernels.norm_x import Norm, gemv_norm_ref
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
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (Qwen3 8B shapes)")
EPS = 1e-6


def q8_args(N, K, seed):
    w = (torch.randn(N, K, generator=gen(seed)) * 0.05).numpy()
    return tuple(torch.from_numpy(a).to(DEV) for a in quantize_q8_0(w))


def affine_args(N, K, bits, gs, seed, dtype):
    w = (torch.randn(N, K, generator=gen(seed)) * 0.05).numpy()
    packed, s, b = quantize_affine(w, bits, gs)
    return (
        torch.from_numpy(packed.view(np.int32)).to(DEV),
        torch.from_numpy(s).to(DEV, dtype),
        torch.from_numpy(b).to(DEV, dtype),
        bits,
        gs,
    )


def quantized(kind, N, K, dtype, seed=0):
    """(fused op, plain GEMV, matmul ref, weights) of a quantized GEMV kind at w [N, K]."""
    if kind == "q8_0":
        return qg.q8_0_gemv_norm, qg.q8_0_gemv, qm.q8_0_matmul_ref, q8_args(N, K, seed)
    gs = 128 if kind == "affine4_g128" else 32
    weights = affine_args(N, K, 4, gs, seed, dtype)
    return ag.affine_gemv_norm, ag.affine_gemv, am.affine_matmul_ref, weights


def norm_inputs(K, dtype, with_residual, seed=1):
    hidden = randn(1, K, dtype=dtype, seed=seed, scale=2.0)
    residual = randn(1, K, dtype=dtype, seed=seed + 1, scale=8.0) if with_residual else None
    weight = randn(K, dtype=dtype, seed=seed + 2)
    return hidden, residual, weight


def unfused_norm(hidden, norm):
    """rms_norm's Triton op, as the layers ran it before the fusion."""
    if norm.residual is None:
        return run(rn._rms_norm_op, hidden, norm.weight, norm.eps)
    return run(rn._rms_norm_op, hidden, norm.weight, norm.eps, norm.residual)[0]


def fused_and_plain(fused, plain, weights, hidden, norm, cfg):
    """The fused launch and rms_norm + the GEMV with the same config, both with fp32 outputs
    (the sums before rounding to the dtype), and the fused one's residual."""
    N = weights[0].shape[0]
    out = torch.empty((1, N), dtype=torch.float32, device=DEV)
    got, res = run(fused, hidden, norm, *weights, cfg, out)
    assert got is out
    f32 = torch.empty((1, N), dtype=torch.float32, device=DEV)
    return got, run(plain, unfused_norm(hidden, norm), *weights, cfg, f32), res


# (kind, dtype, int16 x, with a residual): int16 x takes bf16/fp16 x and groups of 32; every
# case with a residual, some without (the first layer's norm, of the embedding alone)
QUANT_CASES = [
    (kind, dtype, int_x, True)
    for kind in ("q8_0", "affine4", "affine4_g128")
    for dtype in DTYPES
    for int_x in (False, True)
    if not int_x or (dtype != torch.float32 and kind != "affine4_g128")
] + [
    ("q8_0", torch.float32, False, False),
    ("q8_0", torch.bfloat16, True, False),
    ("affine4", torch.bfloat16, False, False),
    ("affine4", torch.float16, True, False),
    ("affine4_g128", torch.bfloat16, False, False),
]


@pytest.mark.parametrize(
    "kind,dtype,int_x,with_residual",
    QUANT_CASES,
    ids=[
        f"{k}-{str(d)[6:]}-{'int16x' if i else 'exact'}-{'residual' if r else 'first-layer'}"
        for k, d, i, r in QUANT_CASES
    ],
)
def test_quantized_gemv_with_fused_norm(kind, dtype, int_x, with_residual):
    """N = 37 (masked rows), K = 640: 20 groups of 32 (5 of 128), which no K step divides;
    the norm's row is padded to 1024. With a residual, split-K (a short last split) and the
    prefetching loop; without, one tile a program. Against rms_norm_ref + the matmul
    reference, and against rms_norm + the same GEMV: under the interpreter the two sum s^2 in
    the same order, so they are equal bit for bit; on a GPU within a term of the output."""
    N, K = 37, 640
    fused, plain, ref, weights = quantized(kind, N, K, dtype)
    hidden, residual, weight = norm_inputs(K, dtype, with_residual)
    norm = Norm(weight, EPS, residual)
    if with_residual:
        cfg = dict(BLOCK_N=8, BLOCK_G=8, SPLIT_K=3, num_warps=4, PREFETCH=True, INT_X=int_x)
    else:
        cfg = dict(BLOCK_N=16, BLOCK_G=4, SPLIT_K=1, num_warps=4, PREFETCH=False, INT_X=int_x)
    got, want, res = fused_and_plain(fused, plain, weights, hidden, norm, cfg)
    check_against_unfused(got, want, dtype, kind)
    close(got.to(dtype), gemv_norm_ref(hidden, norm, ref, *weights)[0], dtype)
    check_residual(res, hidden, residual)


DENSE_CFGS = [
    dict(BLOCK_N=8, BLOCK_K=64, SPLIT_K=3, num_warps=4),
    dict(BLOCK_N=4, BLOCK_K=128, SPLIT_K=1, num_warps=2),
]


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("cfg", DENSE_CFGS, ids=["split3", "one-split"])
def test_dense_gemv_with_fused_norm(cfg, dtype, with_residual):
    """K = 300: no K step divides it, masked columns in the norm's row and the GEMV's steps."""
    N, K = 37, 300
    w = randn(N, K, dtype=dtype, seed=5, scale=0.05)
    hidden, residual, weight = norm_inputs(K, dtype, with_residual)
    norm = Norm(weight, EPS, residual)
    got, res = run(dg.dense_gemv_norm, hidden, norm, w, cfg)
    assert got.dtype == dtype and got.shape == (1, N)
    check_against_unfused(
        got, run(dg._dense_gemv_op, unfused_norm(hidden, norm), w, False, cfg), dtype, "dense"
    )
    close(got, dg.dense_gemv_norm_ref(hidden, norm, w)[0], dtype)
    check_residual(res, hidden, residual)


def test_fused_norm_row_longer_than_one_norm_step():
    """K = 4224 > 4096: the prologue sums s^2 in two steps (a masked second one), so the order
    differs from rms_norm's one-step sum: equal within fp32 rounding."""
    N, K = 9, 4224
    hidden, residual, weight = norm_inputs(K, torch.float32, True, seed=7)
    norm = Norm(weight, EPS, residual)
    cfg = dict(BLOCK_N=16, BLOCK_G=64, SPLIT_K=2, num_warps=4, PREFETCH=True)
    for kind in ("q8_0", "affine4_g128"):
        fused, plain, ref, weights = quantized(kind, N, K, torch.float32, seed=3)
        got, want, res = fused_and_plain(fused, plain, weights, hidden, norm, cfg)
        close(got, want, torch.float32)
        close(got, gemv_norm_ref(hidden, norm, ref, *weights)[0], torch.float32)
        check_residual(res, hidden, residual)


def check_against_unfused(got, want, dtype, what):
    if not HAS_CUDA:  # the interpreter: the same sums in the same order
        assert torch.equal(got, want), what
        return
    # On a GPU rstd's sum runs in another order, which may move a normed x by one ulp of the
    # dtype: a term's worth, far under the output's rounding to the dtype.
    close(got, want, dtype, scale=got.abs().max().item() * 0.1)


def check_residual(res, hidden, residual):
    if residual is None:
        assert res is hidden or torch.equal(res, hidden)
        return
    want = (hidden + residual).to(hidden.dtype)
    # The model-dtype add; the interpreter's bf16 rounding is 1 ulp off (as in rms_norm's test).
    if hidden.dtype == torch.bfloat16 and not HAS_CUDA:
        close(res, want, hidden.dtype)
    else:
        assert torch.equal(res, want)
    assert res.data_ptr() not in (hidden.data_ptr(), residual.data_ptr())


# -- the layers and the model -------------------------------------------------------------------


def interpreted_kernels(monkeypatch):
    """Triton kernels on CPU (the interpreter) for the model's dispatched ops; any fallback
    fails the test."""
    if HAS_CUDA:
        pytest.skip("on a GPU the kernels run natively (test_gpu_fused_norm_decode_in_a_graph)")
    monkeypatch.setenv("KIPP_CUDA_INTERPRET", "1")
    monkeypatch.setenv("KIPP_CUDA_REQUIRE_KERNELS", "1")


def counting(monkeypatch, name):
    """Count the calls the layers make to kipp_cuda.layers.<name>."""
    import kipp_cuda.layers as layers

    calls = []
    fn = getattr(layers, name)
    monkeypatch.setattr(layers, name, lambda *a, **k: calls.append(1) or fn(*a, **k))
    return calls


@pytest.mark.parametrize("scheme", ["q8_0", "affine4"])
def test_forward_norm_fuses_one_token_only(scheme, monkeypatch):
    """Linear.forward_norm: one token takes the fused GEMV, equal bit for bit to rms_norm and
    the linear under the interpreter; more tokens, or rms_norm switched off, take them apart."""
    from kipp_cuda.layers import make_linear
    from kipp_cuda.quant import quantize

    interpreted_kernels(monkeypatch)
    fused = "q8_0_gemv_norm" if scheme == "q8_0" else "affine_gemv_norm"
    calls = counting(monkeypatch, fused)
    K = 96
    lin = make_linear(quantize(randn(40, K, seed=3, scale=0.05), scheme), scheme)
    hidden, residual, weight = norm_inputs(K, torch.float32, True)
    out, res = run(lin.forward_norm, hidden, residual, weight, EPS)
    assert len(calls) == 1
    h, res_want = rn.rms_norm(hidden, weight, EPS, residual)
    assert torch.equal(out, lin(h)) and torch.equal(res, res_want)
    out, res = lin.forward_norm(hidden, None, weight, EPS)  # the first layer
    assert len(calls) == 2 and res is hidden
    assert torch.equal(out, lin(rn.rms_norm(hidden, weight, EPS)))
    rows = randn(3, K, seed=9)
    out3, res3 = lin.forward_norm(rows, rows * 2, weight, EPS)
    h3, want3 = rn.rms_norm(rows, weight, EPS, rows * 2)
    assert len(calls) == 2 and torch.equal(out3, lin(h3)) and torch.equal(res3, want3)
    monkeypatch.setenv("KIPP_CUDA_DISABLE_KERNELS", "rms_norm")
    lin.forward_norm(hidden, residual, weight, EPS)
    assert len(calls) == 2


def test_fused_norm_is_off_unless_asked(monkeypatch):
    from kipp_cuda.layers import fused_norm_enabled

    monkeypatch.delenv("KIPP_CUDA_FUSED_NORM", raising=False)
    assert not fused_norm_enabled()
    monkeypatch.setenv("KIPP_CUDA_FUSED_NORM", "1")
    assert fused_norm_enabled()


def test_fused_norm_decode_in_the_model_on_cpu(make_checkpoint, tmp_path, monkeypatch):
    """A whole float32 q8_0 model on CPU (every kernel interpreted), one token a step, so that
    each position runs the one-token GEMVs with their norms fused: the oracle's logits on the
    dequantized checkpoint, with KIPP_CUDA_FUSED_NORM=1 (2 fused GEMVs a layer a token) and 0
    (none). (affine4's fused GEMVs: test_forward_norm_fuses_one_token_only and the kernel
    tests.)"""
    from kipp_core.checkpoint import Checkpoint
    from kipp_core.llm import LLM
    from kipp_core.quantize_checkpoint import quantize_checkpoint
    from oracle.qwen3 import forward, load_weights
    from tests.conftest import rel_err, small_config

    interpreted_kernels(monkeypatch)
    cfg = small_config(vocab_size=256)
    src = make_checkpoint(cfg, seed=8, dtype="float32")
    quantize_checkpoint(Checkpoint(src), tmp_path / "q", "q8_0")
    ids = np.random.default_rng(2).integers(0, 256, size=6).tolist()
    ref = forward(load_weights(Checkpoint(tmp_path / "q")), ids)
    calls = counting(monkeypatch, "q8_0_gemv_norm")
    got = {}
    for flag, want_calls in (("0", 0), ("1", 2 * cfg.num_hidden_layers * len(ids))):
        monkeypatch.setenv("KIPP_CUDA_FUSED_NORM", flag)
        calls.clear()
        llm = LLM(str(tmp_path / "q"), backend="cuda", dtype="float32", max_num_batched_tokens=1)
        got[flag] = llm.logits(ids)
        assert len(calls) == want_calls, flag
        assert rel_err(got[flag], ref) <= 1e-5, flag
    assert rel_err(got["1"], got["0"]) <= 1e-6


# -- GPU: 8B shapes, and decode through a CUDA graph ----------------------------------------------


@gpu
@pytest.mark.parametrize("proj", ["qkv", "gate_up"])
@pytest.mark.parametrize(
    "kind", ["q8_0-exact", "q8_0-int16-x", "affine4-exact", "affine4-int16-x", "dense"]
)
def test_gpu_fused_norm_gemvs_at_8b_shapes(kind, proj, monkeypatch):
    """bf16, w [N, 4096] of 8B's qkv (N = 6144) and gate_up (N = 24576), the tuned configs
    (KIPP_CUDA_INT_X picks the exact fp32 or the int16-x path): the fused launch against rms_norm
    + the same GEMV and against rms_norm_ref + the matmul reference, with and without a
    residual."""
    monkeypatch.setenv("KIPP_CUDA_INT_X", "1" if kind.endswith("int16-x") else "0")
    N, K = bench.linear_shapes()["8B"][proj]
    dtype = torch.bfloat16
    if kind == "dense":
        w = randn(N, K, dtype=dtype, seed=4, scale=0.02)
        fused, plain, ref, weights = dg.dense_gemv_norm, dg._dense_gemv_op, dg.dense_gemv_ref, (w,)
    else:
        fused, plain, ref, weights = quantized(kind.split("-")[0], N, K, dtype, seed=4)
    for with_residual in (True, False):
        hidden, residual, weight = norm_inputs(K, dtype, with_residual, seed=11)
        norm = Norm(weight, EPS, residual)
        got, res = run(fused, hidden, norm, *weights)
        want = run(plain, unfused_norm(hidden, norm), *weights)
        close(got, want, dtype)
        close(got, gemv_norm_ref(hidden, norm, ref, *weights)[0], dtype)
        check_residual(res, hidden, residual)


@gpu
@pytest.mark.parametrize("quant", [None, "q8_0", "affine4"])
def test_gpu_fused_norm_decode_in_a_graph(quant, make_checkpoint, tmp_path, monkeypatch):
    """A bf16 model, one token a step, so every position runs the decode CUDA graph over its
    cached context: logits within the bf16 gate (NMSE 1e-3) of the oracle on the (dequantized)
    checkpoint with KIPP_CUDA_FUSED_NORM=1 and 0, and the fused GEMVs in the captured graph."""
    from kipp_core.checkpoint import Checkpoint
    from kipp_core.llm import LLM
    from kipp_core.quantize_checkpoint import quantize_checkpoint
    from oracle.qwen3 import forward, load_weights
    from tests.conftest import nmse, small_config

    src = make_checkpoint(small_config(vocab_size=1024), seed=8, dtype="float32")
    path = src
    if quant:
        path = tmp_path / "q"
        quantize_checkpoint(Checkpoint(src), path, quant)
    ids = np.random.default_rng(1).integers(0, 1024, size=40).tolist()
    ref = forward(load_weights(Checkpoint(path)), ids)
    name = {None: "dense_gemv_norm", "q8_0": "q8_0_gemv_norm", "affine4": "affine_gemv_norm"}
    calls = counting(monkeypatch, name[quant])
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KIPP_CUDA_FUSED_NORM", flag)
        calls.clear()
        llm = LLM(str(path), backend="cuda", dtype="bfloat16", max_num_batched_tokens=1)
        assert llm.backend.runner.graph_bs, "the decode graphs were not captured"
        got[flag] = llm.logits(ids)
        assert (len(calls) > 0) == (flag == "1"), flag
        assert nmse(got[flag], ref) <= 1e-3, flag
    assert nmse(got["1"], got["0"]) <= 1e-3
