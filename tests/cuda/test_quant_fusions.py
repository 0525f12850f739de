"""What the quantized decode path fuses: SwiGLU in the one-token gate_up GEMV's epilogue (the same
bits as the GEMV then silu_and_mul), and a quantized embedding's rows in one launch (the same bits
as the torch references). On CPU under Triton's interpreter; the 8B shapes are in
test_matmul_kernels' GPU test."""

from __future__ import annotations

import pytest
import torch

from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import embedding as emb
from kipp_cuda.kernels import q8_0_gemv as qg
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels import swiglu as sw
from tests.cuda.kernel_testing import (
    DEV,
    DTYPE_IDS,
    DTYPES,
    HAS_CUDA,
    IDS,
    cases,
    close,
    randn,
    run,
    skip_unless_runnable,
)
from tests.cuda.test_matmul_kernels import affine_weights, q8_weights

skip_unless_runnable()


SWIGLU_CFGS = {
    "one-tile": dict(BLOCK_N=4, BLOCK_G=8, SPLIT_K=1, num_warps=4, PREFETCH=False),
    "split3": dict(BLOCK_N=8, BLOCK_G=4, SPLIT_K=3, num_warps=4, PREFETCH=False),
    "one-row": dict(BLOCK_N=1, BLOCK_G=8, SPLIT_K=1, num_warps=4),  # raised to a gate-up pair
    "prefetch-split2": dict(BLOCK_N=16, BLOCK_G=2, SPLIT_K=2, num_warps=4, PREFETCH=True),
}


# 12 on a GPU; interpreted (each ~10 s), every config and every dtype once: 4
@pytest.mark.parametrize("name, dtype", cases(1, name=list(SWIGLU_CFGS), dtype=DTYPE_IDS))
def test_quantized_gemv_swiglu_epilogue_equals_gemv_then_silu_and_mul(name, dtype):
    """swiglu=True: a GEMV over gate-then-up rows writes silu(gate) * up in its epilogue, the same
    bits as the same GEMV followed by silu_and_mul; I = 37 leaves a short last tile. one-row's
    tile is one gate-up pair, never short: 5 pairs (5 programs, not 37, under the interpreter)."""
    cfg, K = SWIGLU_CFGS[name], 320  # 10 groups: a short last K step
    I = 5 if name == "one-row" else 37
    x = randn(1, K, dtype=dtype, seed=42)
    qs, d, w64 = q8_weights(2 * I, K, seed=41)
    fused = run(qg.q8_0_gemv, x, qs, d, cfg, swiglu=True)
    assert fused.shape == (1, I) and fused.dtype == dtype
    assert torch.equal(fused, sw._silu_and_mul_op(qg.q8_0_gemv(x, qs, d, cfg)))
    close(fused, sw.silu_and_mul_ref((x.double().cpu() @ w64.T).to(dtype)), dtype)
    wq, s, b, _ = affine_weights(2 * I, K, 4, 32, seed=43, sdtype=torch.bfloat16)
    fused = run(ag.affine_gemv, x, wq, s, b, 4, 32, cfg, swiglu=True)
    assert torch.equal(fused, sw._silu_and_mul_op(ag.affine_gemv(x, wq, s, b, 4, 32, cfg)))


@pytest.mark.parametrize("T", [1, 3])
def test_quantized_matmul_swiglu_at_any_t(T):
    """The matmul ops' swiglu=True (the GEMV's epilogue at T = 1, a silu_and_mul launch after the
    product above) against their references; an odd row count is refused."""
    I, K = 24, 256
    x = randn(T, K, dtype=torch.bfloat16, seed=44)
    qs, d, _ = q8_weights(2 * I, K, seed=45)
    want = qm.q8_0_matmul_ref(x, qs, d, swiglu=True)
    assert want.shape == (T, I)
    close(run(qm._q8_0_matmul_op, x, qs, d, swiglu=True), want, torch.bfloat16)
    wq, s, b, _ = affine_weights(2 * I, K, 4, 32, seed=46, sdtype=torch.bfloat16)
    got = run(am._affine_matmul_op, x, wq, s, b, 4, 32, swiglu=True)
    close(got, am.affine_matmul_ref(x, wq, s, b, 4, 32, swiglu=True), torch.bfloat16)
    with pytest.raises(ValueError, match="gate and up"):
        qm.q8_0_matmul(x, qs[:-1], d[:-1], swiglu=True)


@pytest.mark.parametrize("scheme", [None, "q8_0", "affine4"])
def test_swiglu_mlp_on_kernels_equals_references(scheme, monkeypatch):
    """layers.swiglu_mlp at T = 1 (SwiGLU in the quantized gate_up GEMV's epilogue, or in the
    dense down GEMV's reads of x on a GPU) against down(silu_and_mul(gate_up(h))) on the
    plain-torch references."""
    from kipp_cuda.layers import make_linear, swiglu_mlp
    from kipp_cuda.quant import quantize

    I, H = 64, 128  # (multiples of 32: the quantization groups)
    w = {n: randn(*shape, seed=i, scale=0.1) for i, (n, shape) in enumerate(
        [("gate_up", (2 * I, H)), ("down", (H, I))])}  # fmt: skip
    parts = {n: quantize(t, scheme) if scheme else {"weight": t} for n, t in w.items()}
    gate_up, down = (make_linear(parts[n], scheme) for n in ("gate_up", "down"))
    h = randn(1, H, dtype=torch.float32, seed=5)
    monkeypatch.setenv("KIPP_CUDA_INTERPRET", "1")  # kernels (native on a GPU)
    got = run(swiglu_mlp, gate_up, down, h)
    monkeypatch.setenv("KIPP_CUDA_DISABLE_KERNELS", "all")  # every op on its reference
    want = down(sw.silu_and_mul_ref(gate_up(h)))
    close(got, want, torch.float32, scale=want.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_quantized_embeddings_equal_their_references(dtype):
    """One launch dequantizes the rows: the reference's bits (no FMA in q * scale + bias), and
    the rows of the dequantized table; repeated and edge ids, K not a multiple of the block."""

    def same(got, want):  # (the interpreter rounds fp32 to bf16 by truncation: only close there)
        if HAS_CUDA or dtype != torch.bfloat16:
            assert torch.equal(got, want)
        else:
            close(got, want, dtype)

    ids = torch.tensor([0, 49, 7, 7], device=DEV)
    qs, d, w64 = q8_weights(50, 1120, seed=4)
    got = run(emb._q8_0_embedding_op, ids, qs, d, dtype)
    assert got.dtype == dtype
    same(got, emb.q8_0_embedding_ref(ids, qs, d, dtype))
    assert torch.equal(run(emb._q8_0_embedding_op, ids, qs, d).double().cpu(), w64[ids.cpu()])
    for bits in (4, 8):
        wq, s, b, w64 = affine_weights(50, 1120, bits, 32, seed=7, sdtype=torch.bfloat16)
        got = run(emb._affine_embedding_op, ids, wq, s, b, bits, 32, dtype)
        want = emb.affine_embedding_ref(ids, wq, s, b, bits, 32, dtype)
        same(got, want)
        close(run(emb._affine_embedding_op, ids, wq, s, b, bits, 32), w64[ids.cpu()], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_embeddings_take_flagged_rows_from_last(dtype):
    """take_last=(flags, last): row t is last[t] where flags[t] != 0, else ids[t] (a decode
    graph's PENDING ids), for the dense and quantized kinds; hand-picked expected ids. A dense
    table's rows are copied exactly."""
    ids = torch.tensor([3, 9, 0, 4], device=DEV)
    flags = torch.tensor([0, 1, 1, 0, 1], device=DEV)  # longer than ids: a graph's padded rows
    last = torch.tensor([40, 12, 49, 41, 5], device=DEV)
    rows = [3, 12, 49, 4]  # by hand
    w = randn(50, 1100, dtype=dtype, seed=9)
    got = run(emb._dense_embedding_op, ids, w, take_last=(flags, last))
    assert got.dtype == dtype and torch.equal(got, w[rows])
    assert torch.equal(emb.dense_embedding_ref(ids, w, take_last=(flags, last)), w[rows])
    assert torch.equal(run(emb._dense_embedding_op, ids, w, torch.float32), w[ids].float())
    qs, d, _ = q8_weights(50, 1120, seed=4)
    want = emb.q8_0_embedding_ref(torch.tensor(rows, device=DEV), qs, d)
    assert torch.equal(run(emb._q8_0_embedding_op, ids, qs, d, take_last=(flags, last)), want)
    assert torch.equal(emb.q8_0_embedding_ref(ids, qs, d, take_last=(flags, last)), want)
    wq, s, b, _ = affine_weights(50, 1120, 4, 32, seed=7, sdtype=torch.bfloat16)
    want = emb.affine_embedding_ref(torch.tensor(rows, device=DEV), wq, s, b, 4, 32)
    got = run(emb._affine_embedding_op, ids, wq, s, b, 4, 32, take_last=(flags, last))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="take_last flags"):
        emb.dense_embedding(ids, w, take_last=(flags[:2], last))
    with pytest.raises(ValueError, match="take_last ids"):
        emb.q8_0_embedding(ids, qs, d, take_last=(flags, last.float()))
