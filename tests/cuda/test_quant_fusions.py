"""What the quantized decode path fuses: SwiGLU in the one-token gate_up GEMV's epilogue (the same
bits as the GEMV then silu_and_mul), and a quantized embedding's rows in one launch (the same bits
as the torch references). On CPU under Triton's interpreter; the 8B shapes are in
test_matmul_kernels' GPU test."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import embedding as emb
from kipp_cuda.kernels import q8_0_gemv as qg
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels import swiglu as sw
from kipp_cuda.kernels.bits import new_xq, quant_x16, xq_ref
from kipp_cuda.kernels.rms_norm import _rms_norm_op, rms_norm_ref
from tests.cuda.kernel_testing import (
    DEV,
    DTYPES,
    HAS_CUDA,
    IDS,
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


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("name", list(SWIGLU_CFGS))
def test_quantized_gemv_swiglu_epilogue_equals_gemv_then_silu_and_mul(name, dtype):
    """swiglu=True: a GEMV over gate-then-up rows writes silu(gate) * up in its epilogue, the same
    bits as the same GEMV followed by silu_and_mul; I = 37 leaves a short last tile."""
    cfg, I, K = SWIGLU_CFGS[name], 37, 320  # 10 groups: a short last K step
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


@triton.jit
def _quant_x16_kernel(x_ptr, w_ptr, s_ptr, t_ptr, ASM: tl.constexpr):
    g = tl.program_id(0)
    one = tl.zeros([1], tl.int32)
    words, xs, total = quant_x16(x_ptr, g * 32 + one, True, ASM)
    for p in tl.static_range(16):
        tl.store(w_ptr + g * 16 + p + one, words[p])
    tl.store(s_ptr + g + one, xs)
    tl.store(t_ptr + g + one, total)


def _quant_x16_words(x):
    """bits.quant_x16's (words, xs, sum) of every group of one row x [K], by a Triton kernel
    (interpreted on CPU): the reference that write_xq must equal."""
    G = x.shape[-1] // 32
    out = (
        torch.empty(G * 16, dtype=torch.int32, device=x.device),
        torch.empty(G, device=x.device),
        torch.empty(G, device=x.device),
    )
    _quant_x16_kernel[(G,)](x.reshape(-1), *out, ASM=x.is_cuda)
    return out


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_writes_the_int16_x_of_quant_x16(residual):
    """rms_norm(xq=...) (one row) writes what every affine GEMV program would make of its output
    (bits.quant_x16): the same words and scales, the group sums within fp32 rounding; its torch
    reference (bits.xq_ref) the same. A group of zeros has scale 0; a NaN makes the scales NaN (it
    reaches the GEMV's output instead of vanishing)."""
    H = 320
    x = randn(1, H, dtype=torch.bfloat16, seed=51)
    x[0, 64:96] = 0.0  # group 2: zeros
    w = randn(H, dtype=torch.bfloat16, seed=52)
    r = randn(1, H, dtype=torch.bfloat16, seed=53) if residual else None
    if residual:
        r[0, 64:96] = 0.0
    xq = new_xq(H, DEV)
    out = _rms_norm_op(x, w, 1e-6, r, xq=xq)
    h = out[0] if residual else out
    assert torch.equal(h, _rms_norm_op(x, w, 1e-6, r)[0] if residual else _rms_norm_op(x, w, 1e-6))
    words, xs, total = _quant_x16_words(h)
    assert torch.equal(xq[0], words) and torch.equal(xq[1], xs)
    assert xq[1][2] == 0 and torch.equal(xq[0][32:48], torch.zeros_like(xq[0][32:48]))
    torch.testing.assert_close(xq[2], total, rtol=1e-6, atol=1e-6)
    torch_words, torch_xs, torch_total = xq_ref(h[0])
    assert torch.equal(torch_words, words) and torch.equal(torch_xs, xs)
    torch.testing.assert_close(torch_total, total, rtol=1e-6, atol=1e-6)
    ref = new_xq(H, DEV)
    ref_out = rms_norm_ref(x, w, 1e-6, r, xq=ref)
    for got, want in zip(ref, xq_ref((ref_out[0] if residual else ref_out)[0])):
        assert torch.equal(got, want)
    x[0, 5] = float("nan")
    _rms_norm_op(x, w, 1e-6, r, xq=xq)
    assert xq[1].isnan().all()  # (the norm spreads it over the row)
    with pytest.raises(ValueError, match="xq takes one row"):
        _rms_norm_op(x.expand(2, H), w, 1e-6, xq=xq)


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_affine_gemv_reading_xq_equals_making_it(swiglu):
    """affine_gemv with x's int16 form from rms_norm (xq) computes what its programs compute from
    x: within fp32 rounding of the group sums (the only part that differs), on the int16-x
    path; a config off that path ignores xq."""
    N, K = 74, 320
    x = randn(1, K, dtype=torch.bfloat16, seed=61)
    xq = new_xq(K, DEV)
    h = _rms_norm_op(x, randn(K, dtype=torch.bfloat16, seed=62), 1e-6, xq=xq)
    wq, s, b, _ = affine_weights(N, K, 4, 32, seed=63, sdtype=torch.bfloat16)
    for cfg in SWIGLU_CFGS.values():
        cfg = {**cfg, "INT_X": True}
        want = run(ag.affine_gemv, h, wq, s, b, 4, 32, cfg, swiglu=swiglu)
        got = run(ag.affine_gemv, h, wq, s, b, 4, 32, cfg, swiglu=swiglu, xq=xq)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert (got.float() - want.float()).abs().max() <= 2**-6 * want.float().abs().max()
        assert (got == want).float().mean() > 0.9  # most outputs round to the same bits
    off = {**SWIGLU_CFGS["one-tile"], "INT_X": False}
    plain = run(ag.affine_gemv, h, wq, s, b, 4, 32, off)
    assert torch.equal(run(ag.affine_gemv, h, wq, s, b, 4, 32, off, xq=xq), plain)
