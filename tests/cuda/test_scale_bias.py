"""Affine scales and biases interleaved in one [N, G, 2] buffer (quant.interleave_scale_bias, as
AffineLinear stores them): the one-token GEMV reads a group's pair in one 32-bit load (PACKED), the
matmul and embedding kernels take the views' stride. Each must give the same bits as the two
separate tensors, and the values kipp_core.quant's numpy dequantization gives. CPU interpreter on
odd shapes; the 8B shapes on the GPU."""

from __future__ import annotations

import pytest
import torch

from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import embedding as emb
from kipp_cuda.layers import AffineLinear
from kipp_cuda.quant import interleave_scale_bias
from tests.cuda.kernel_testing import DEV, HAS_CUDA, close, randn, run, skip_unless_runnable
from tests.cuda.test_matmul_kernels import affine_weights

skip_unless_runnable()

SB_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SB_IDS = ["bf16", "fp16", "fp32"]
GEMV_CFGS = {
    "one-tile": dict(BLOCK_N=8, BLOCK_G=4, SPLIT_K=1, num_warps=4, PREFETCH=False),
    "split3": dict(BLOCK_N=4, BLOCK_G=8, SPLIT_K=3, num_warps=4, PREFETCH=False),
    "prefetch-int-x": dict(
        BLOCK_N=16, BLOCK_G=2, SPLIT_K=2, num_warps=4, PREFETCH=True, INT_X=True
    ),
}


def views(s, b):
    sb = interleave_scale_bias(s, b)
    return sb[..., 0], sb[..., 1]


@pytest.mark.parametrize("sdtype", SB_DTYPES, ids=SB_IDS)
def test_scale_bias_operands_packs_only_an_interleaved_16_bit_pair(sdtype):
    _, s, b, _ = affine_weights(5, 256, 4, 32, seed=1, sdtype=sdtype)
    si, bi = views(s, b)
    assert ag.scale_bias_operands(s, b)[2] == 0  # two tensors: two loads
    words, _, kind = ag.scale_bias_operands(si, bi)
    assert kind == {torch.bfloat16: 2, torch.float16: 1, torch.float32: 0}[sdtype]
    if kind:  # one int32 a group: the scale's bits low, the bias's high (little-endian)
        assert words.dtype == torch.int32 and words.shape == s.shape
        bits = s.view(torch.int16).to(torch.int32) & 0xFFFF
        assert torch.equal(words, bits | (b.view(torch.int16).to(torch.int32) << 16))
    swapped = interleave_scale_bias(b, s)  # biases first: not the layout PACKED reads
    assert ag.scale_bias_operands(swapped[..., 1], swapped[..., 0])[2] == 0


# (scales' dtype, launch config, bits, group size): both PACKED kinds, the strided fp32 views,
# every config, bits 4 and 8, group sizes 32 and 128
GEMV_CASES = [
    (torch.bfloat16, "one-tile", 4, 32),
    (torch.float16, "split3", 8, 32),
    (torch.float32, "one-tile", 4, 128),
    (torch.bfloat16, "prefetch-int-x", 4, 32),
    (torch.float16, "prefetch-int-x", 4, 32),
    (torch.bfloat16, "split3", 8, 32),
]


@pytest.mark.parametrize(
    "sdtype,cfg,bits,gs",
    GEMV_CASES,
    ids=[f"{str(c[0])[6:]}-{c[1]}-{c[2]}-{c[3]}" for c in GEMV_CASES],
)
def test_gemv_on_interleaved_scales_equals_separate(sdtype, cfg, bits, gs):
    """Masked rows, a short last K split (13 groups in 3), groups that do not fill a K step; x in
    the scales' dtype (fp32 x takes the exact path)."""
    cfg = GEMV_CFGS[cfg]
    N, K = 37, gs * 13
    wq, s, b, w64 = affine_weights(N, K, bits, gs, seed=bits + gs, sdtype=sdtype)
    x = randn(1, K, dtype=sdtype, seed=3)
    plain = run(ag.affine_gemv, x, wq, s, b, bits, gs, cfg)
    packed = run(ag.affine_gemv, x, wq, *views(s, b), bits, gs, cfg)
    assert torch.equal(packed, plain)
    if not cfg.get("INT_X"):  # (int16 x has its own bound: test_matmul_kernels)
        close(packed, x.double().cpu() @ w64.T, sdtype)


def test_gemv_swiglu_epilogue_on_interleaved_scales():
    """gate_up's launch (gate and up rows in one program) reads the same pairs."""
    N, K = 40, 512
    wq, s, b, _ = affine_weights(N, K, 4, 32, seed=7, sdtype=torch.bfloat16)
    x = randn(1, K, dtype=torch.bfloat16, seed=8)
    cfg = GEMV_CFGS["one-tile"]
    plain = run(ag.affine_gemv, x, wq, s, b, 4, 32, cfg, swiglu=True)
    assert torch.equal(run(ag.affine_gemv, x, wq, *views(s, b), 4, 32, cfg, swiglu=True), plain)


@pytest.mark.parametrize("sdtype", SB_DTYPES, ids=SB_IDS)
def test_matmul_and_embedding_take_the_views_stride(sdtype):
    N, K = 40, 352
    wq, s, b, w64 = affine_weights(N, K, 4, 32, seed=9, sdtype=sdtype)
    si, bi = views(s, b)
    for T in (5, 20):  # the 16-row dot path, then the prefill tiles
        x = randn(T, K, dtype=sdtype, seed=T)
        plain = run(am._affine_matmul_op, x, wq, s, b, 4, 32)
        assert torch.equal(run(am._affine_matmul_op, x, wq, si, bi, 4, 32), plain)
        close(plain, x.double().cpu() @ w64.T, sdtype)
    ids = torch.tensor([3, 0, 39, 3], device=DEV)
    rows = run(emb._affine_embedding_op, ids, wq, si, bi, 4, 32)
    assert torch.equal(rows, run(emb._affine_embedding_op, ids, wq, s, b, 4, 32))
    close(rows, w64[ids.cpu()], torch.float32)


def test_affine_linear_keeps_one_interleaved_buffer():
    wq, s, b, _ = affine_weights(12, 128, 4, 32, seed=10, sdtype=torch.bfloat16)
    layer = AffineLinear(wq, s, b, 4, 32)
    assert [n for n, _ in layer.named_buffers()] == ["wq", "scale_bias"]
    assert torch.equal(layer.scales, s) and torch.equal(layer.biases, b)
    assert ag.scale_bias_operands(layer.scales, layer.biases)[2] == 2


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (Qwen3 8B shapes)")
def test_gpu_packed_scale_bias_equals_separate_at_8b_shapes():
    """The inline-PTX path on the GPU with the tuned configs (int16 x): bit for bit."""
    for N, K in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        s = (torch.rand(N, K // 32, device=DEV) * 0.01).bfloat16()
        b = (torch.rand(N, K // 32, device=DEV) * -0.05).bfloat16()
        wq = torch.randint(-(2**31), 2**31, (N, K // 8), dtype=torch.int32, device=DEV)
        x = randn(1, K, dtype=torch.bfloat16, seed=N)
        plain = run(ag.affine_gemv, x, wq, s, b, 4, 32)
        assert torch.equal(run(ag.affine_gemv, x, wq, *views(s, b), 4, 32), plain), (N, K)
        close(plain, am.affine_matmul_ref(x, wq, s, b, 4, 32), torch.bfloat16)
