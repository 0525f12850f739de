"""RMSNorm folded into the one-token GEMVs (kernels/norm_fold.py), against rms_norm's reference
(transformers' Qwen3RMSNorm order) and the plain GEMV: the producer's residual add, s * w and
partial sums of s^2, and the consumer's r-scaled sums, for dense, q8_0 and affine4 weights, fp32
and int16 x, split K and SwiGLU; on CPU under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import dense_gemv as dg
from kipp_cuda.kernels import q8_0_gemv as qg
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels.norm_fold import Fold, Folded, fold_ref
from kipp_cuda.kernels.rms_norm import rms_norm_ref
from tests.cuda.kernel_testing import (
    DTYPES,
    HAS_CUDA,
    IDS,
    close,
    poisoned_empty,
    randn,
    run,
    skip_unless_runnable,
)
from tests.cuda.test_head_argmax import weights

skip_unless_runnable()

KINDS = ["q8_0", "affine4", "dense"]
H, K_IN, N_OUT = 320, 192, 96  # the norm's width; a producer's K; a consumer's rows
EPS = 1e-6
CFGS = {  # (dense takes BLOCK_K = 32 BLOCK_G)
    "one-tile": dict(BLOCK_N=32, BLOCK_G=16, SPLIT_K=1, num_warps=4, PREFETCH=False),
    "prefetch-split2": dict(BLOCK_N=64, BLOCK_G=2, SPLIT_K=2, num_warps=4, PREFETCH=True),
    "int16-x": dict(BLOCK_N=16, BLOCK_G=4, SPLIT_K=1, num_warps=4, PREFETCH=False, INT_X=True),
}


def gemv(kind, x, w, cfg, **kw):
    if kind == "q8_0":
        return qg.q8_0_gemv(x, *w, cfg, **kw)
    if kind == "affine4":
        return ag.affine_gemv(x, *w, 4, 32, cfg, **kw)
    cfg = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=32 * cfg["BLOCK_G"], SPLIT_K=cfg["SPLIT_K"])
    return dg._dense_gemv_op(x, *w, False, {**cfg, "num_warps": 4}, **kw)


def run_fold(op, *args, **kw):
    """run() for ops that may return a Folded: every output poisoned first, checked written."""
    with poisoned_empty():
        out = op(*args, **kw)
    ts = (out.xw, out.residual, out.sq) if isinstance(out, Folded) else (out,)
    for t in ts:
        assert torch.isfinite(t).all(), "an output element was left unwritten"
    return out


def same(got, want, dtype):
    """Bit-equal, except where the interpreter rounds fp32 to bf16 by truncation (close there)."""
    if HAS_CUDA or dtype != torch.bfloat16:
        assert torch.equal(got, want)
    else:
        close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize("kind", KINDS)
def test_producer_adds_the_residual_and_writes_the_norms_inputs(kind, cfg, dtype):
    """s = the plain GEMV's output + residual rounded as rms_norm adds; xw = s * w rounded; one
    partial sum of s^2 a row block, summing to s's (N = 320 is no multiple of 64: clamped rows)."""
    w = weights(kind, H, K_IN, dtype, seed=1)
    x = randn(1, K_IN, dtype=dtype, seed=2)
    res = randn(1, H, dtype=dtype, seed=3, scale=4.0)
    nw = randn(H, dtype=dtype, seed=4)
    plain = run(gemv, kind, x, w, CFGS[cfg])
    got = run_fold(gemv, kind, x, w, CFGS[cfg], fold=Fold(res, nw, EPS))
    want = fold_ref(plain, Fold(res, nw, EPS))
    _, s_ref = rms_norm_ref(plain, nw, EPS, res)  # the unfolded model's new residual
    same(got.residual, s_ref, dtype)
    same(got.xw, want.xw, dtype)
    assert got.sq.dtype == torch.float32 and got.sq.numel() == -(-H // CFGS[cfg]["BLOCK_N"])
    # the sums are of the s it wrote (on CPU that s is the interpreter's truncated bf16)
    torch.testing.assert_close(got.sq.sum(), got.residual.float().pow(2).sum(), rtol=1e-5, atol=0)
    assert got.weight is nw and got.eps == EPS


def folded_input(dtype, parts, seed):
    """A Folded of a random s with its partial sums of s^2 cut into `parts` uneven pieces."""
    s = randn(1, H, dtype=dtype, seed=seed, scale=3.0)
    nw = randn(H, dtype=dtype, seed=seed + 1)
    sq = s.float().pow(2)[0]
    cuts = [0, 7, 100, 101, 250, H][:parts] + [H]
    sums = torch.stack([sq[a:b].sum() for a, b in zip(cuts, cuts[1:])])
    return Folded((s.float() * nw.float()).to(dtype), s, sums, nw, EPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize("kind", KINDS)
def test_consumer_equals_the_gemv_of_the_normed_input(kind, cfg, dtype):
    """The GEMV of xw scaled by r from 6 partial sums: the plain GEMV of rms_norm(s) within the
    op tolerance (the two round at the dtype's last bit in different places)."""
    norm = folded_input(dtype, 6, seed=5)
    w = weights(kind, N_OUT, H, dtype, seed=7)
    got = run_fold(gemv, kind, norm.xw, w, CFGS[cfg], norm=norm)
    want = run(gemv, kind, rms_norm_ref(norm.residual, norm.weight, EPS), w, CFGS[cfg])
    close(got, want, dtype)
    # and far from the unscaled GEMV of xw: the scale is applied
    unscaled = run(gemv, kind, norm.xw, w, CFGS[cfg])
    assert (unscaled.float() - want.float()).abs().max() > 10 * (
        got.float() - want.float()
    ).abs().max()


@pytest.mark.parametrize("kind", ["q8_0", "affine4"])
def test_consumer_with_swiglu_and_the_matmul_references(kind):
    """gate_up with its SwiGLU epilogue takes the scale before it; the matmul ops' references
    (norm_ref, fold_ref) give the same results as the kernels."""
    dtype = torch.bfloat16
    norm = folded_input(dtype, 1, seed=9)
    w = weights(kind, 2 * N_OUT, H, dtype, seed=10)
    mm = qm.q8_0_matmul if kind == "q8_0" else am.affine_matmul
    extra = () if kind == "q8_0" else (4, 32)
    got = run_fold(mm.op, norm.xw, *w, *extra, swiglu=True, norm=norm)
    want = mm.ref(norm.xw, *w, *extra, swiglu=True, norm=norm)
    close(got, want, dtype)
    res = randn(1, 2 * N_OUT, dtype=dtype, seed=11)
    fold = Fold(res, randn(2 * N_OUT, dtype=dtype, seed=12), EPS)
    x = randn(1, H, dtype=dtype, seed=13)
    got, want = run_fold(mm.op, x, *w, *extra, fold=fold), mm.ref(x, *w, *extra, fold=fold)
    close(got.residual, want.residual, dtype)
    close(got.xw, want.xw, dtype)
    torch.testing.assert_close(got.sq.sum(), got.residual.float().pow(2).sum(), rtol=1e-5, atol=0)


def test_bad_fold_inputs_name_the_field():
    w = weights("q8_0", H, K_IN, torch.float32, seed=1)
    x = randn(1, K_IN, seed=2)
    with pytest.raises(ValueError, match="fold: residual"):
        qg.q8_0_gemv(x, *w, fold=Fold(randn(1, H + 1), randn(H), EPS))
    with pytest.raises(ValueError, match="one row"):
        qm.q8_0_matmul.op(randn(2, K_IN), *w, fold=Fold(randn(1, H), randn(H), EPS))
    norm = folded_input(torch.float32, 2, seed=3)
    with pytest.raises(ValueError, match="norm: xw"):
        qg.q8_0_gemv(x, *w, norm=norm)


GPU_ONLY = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a GPU: the quantized model under the interpreter takes minutes"
)


@pytest.mark.parametrize(
    "scheme", [None, pytest.param("q8_0", marks=GPU_ONLY), pytest.param("affine4", marks=GPU_ONLY)]
)
def test_folded_norms_in_the_model(scheme, tiny_path, monkeypatch):
    """One token a step (every position takes the one-token GEMVs over its cached context): with
    the fold, the model launches 2 norms a token (the first layer's input norm and the final one)
    instead of 2 L + 1, and its float32 logits equal the unfolded model's within 1e-5."""
    import kipp_cuda.tp_reduce as tp_reduce
    from kipp_core.checkpoint import Checkpoint
    from kipp_core.llm import LLM
    from tests.conftest import rel_err

    if not HAS_CUDA:
        monkeypatch.setenv("KIPP_CUDA_INTERPRET", "1")  # the kernels under the interpreter
    monkeypatch.setenv("KIPP_CUDA_REQUIRE_KERNELS", "1")
    calls = []
    norm = tp_reduce.rms_norm
    monkeypatch.setattr(tp_reduce, "rms_norm", lambda *a, **k: calls.append(1) or norm(*a, **k))
    ids = list(range(300, 306))
    L = Checkpoint(tiny_path).config.num_hidden_layers
    logits, counts = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KIPP_CUDA_NORM_FOLD", flag)
        llm = LLM(
            str(tiny_path), backend="cuda", dtype="float32", quant=scheme, max_num_batched_tokens=1
        )
        calls.clear()
        logits[flag], counts[flag] = llm.logits(ids), len(calls)
    assert counts == {"0": len(ids) * (2 * L + 1), "1": len(ids) * 2}
    assert rel_err(logits["1"], logits["0"]) <= 1e-5
