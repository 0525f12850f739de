"""Head mode of the one-token GEMVs (kernels/head_argmax.py): fp32 logits with the bits of the
plain GEMV's output .float(), and a greedy argmax folded into one int64 key that finish_argmax
decodes and re-arms; against torch.argmax of those logits (ties and NaN as torch documents), on
CPU under Triton's interpreter; plus an offline sm_90 compile of the head-mode kernels."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kipp_cuda.kernels import affine_gemv as ag
from kipp_cuda.kernels import affine_matmul as am
from kipp_cuda.kernels import dense_gemv as dg
from kipp_cuda.kernels import head_argmax as ha
from kipp_cuda.kernels import q8_0_gemv as qg
from kipp_cuda.kernels import q8_0_matmul as qm
from kipp_cuda.kernels import sass
from tests.cuda.kernel_testing import (
    DEV,
    DTYPE_IDS,
    DTYPES,
    IDS,
    cases,
    close,
    compile_offline,
    randn,
    run,
    skip_unless_runnable,
)
from tests.cuda.test_matmul_kernels import affine_weights, q8_weights

skip_unless_runnable()

KINDS = ["q8_0", "affine4", "dense"]
N, K = 781, 320  # no power-of-two BLOCK_N divides N (clamped rows); 10 groups of 32
# Quantized configs as written; dense takes BLOCK_K = 32 BLOCK_G.
CFGS = {
    "one-program": dict(BLOCK_N=1024, BLOCK_G=16, SPLIT_K=1, num_warps=4, PREFETCH=True),
    "one-tile": dict(BLOCK_N=64, BLOCK_G=16, SPLIT_K=1, num_warps=4, PREFETCH=False),
    "prefetch-split2": dict(BLOCK_N=128, BLOCK_G=4, SPLIT_K=2, num_warps=4, PREFETCH=True),
    "split3": dict(BLOCK_N=256, BLOCK_G=2, SPLIT_K=3, num_warps=4, PREFETCH=False),
    # the tuned 8B affine4 head's mode: its one K step's tile loaded before the PDL wait (q8_0
    # reads 2 as PREFETCH on, dense has no such option)
    "early-one-step": dict(BLOCK_N=64, BLOCK_G=16, SPLIT_K=1, num_warps=4, PREFETCH=2),
}


def weights(kind, n, k, dtype, seed):
    """The weight tensors of a kind, each with one row per output."""
    if kind == "q8_0":
        return q8_weights(n, k, seed)[:2]
    if kind == "affine4":
        return affine_weights(n, k, 4, 32, seed, sdtype=dtype)[:3]
    return (randn(n, k, dtype=dtype, seed=seed),)


def gemv(kind, x, w, cfg, head_keys=None):
    if kind == "q8_0":
        return qg.q8_0_gemv(x, *w, cfg, head_keys=head_keys)
    if kind == "affine4":
        return ag.affine_gemv(x, *w, 4, 32, cfg, head_keys=head_keys)
    # A dense tile of at most 16k elements: one-program's 1024 x 512 takes minutes to compile on
    # a GPU (benchmarks/LOG.md, entry 77f53e4).
    bn = cfg["BLOCK_N"]
    bk = min(32 * cfg["BLOCK_G"], 16384 // bn)
    dense_cfg = dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=cfg["SPLIT_K"], num_warps=4)
    return dg._dense_gemv_op(x, *w, False, dense_cfg, head_keys=head_keys)


def head_token(kind, x, w, cfg, keys):
    """(fp32 logits, token) of a head-mode call and finish_argmax; the keys come back re-armed."""
    logits = run(gemv, kind, x, w, cfg, keys)
    assert logits.dtype == torch.float32 and logits.shape == (1, w[0].shape[0])
    out = torch.full((1,), -1, dtype=torch.int64, device=DEV)
    ha._finish_argmax_op(keys, out)
    assert (keys == ha.KEY_MIN).all()
    return logits, int(out[0])


# 45 on a GPU, 15 interpreted (each ~5 s): every pair of (kind, config, dtype) values
@pytest.mark.parametrize("kind, cfg, dtype", cases(kind=KINDS, cfg=list(CFGS), dtype=DTYPE_IDS))
def test_head_mode_equals_gemv_float_and_argmax(kind, cfg, dtype):
    """Logits: the plain GEMV's bits .float(); token: torch.argmax of them; the same keys serve a
    second call whose best value is below the first's (x negated and scaled to about half the
    first's best), so a stale key would win."""
    cfg = CFGS[cfg]
    w = weights(kind, N, K, dtype, seed=3)
    x = randn(1, K, dtype=dtype, seed=4)
    keys = ha.new_argmax_keys(2, DEV)
    logits, tok = head_token(kind, x, w, cfg, keys)
    assert torch.equal(logits, run(gemv, kind, x, w, cfg).float())
    assert tok == int(torch.argmax(logits))
    scale = 0.5 * logits.max() / -logits.min()
    logits2, tok2 = head_token(kind, (x.float() * -scale).to(dtype), w, cfg, keys)
    assert logits2.max() < logits.max() and tok2 != tok
    assert tok2 == int(torch.argmax(logits2))


@pytest.mark.parametrize("kind, dtype", cases(1, kind=KINDS, dtype=DTYPE_IDS))  # 3 interpreted
def test_ties_go_to_the_lowest_index(kind, dtype):
    """The best row copied to lower and higher indices, in its own tile, a neighbour's and the
    last (split3: 256-row tiles, split K): the lowest copy wins, as torch.argmax."""
    cfg = CFGS["split3"]
    w = weights(kind, N, K, dtype, seed=5)
    x = randn(1, K, dtype=dtype, seed=6)
    best = int(torch.argmax(run(gemv, kind, x, w, cfg)))
    copies = [i for i in (300, 301, best - 1, best + 1, N - 1) if 0 <= i < N and i != best]
    for t in w:
        t[copies] = t[best].clone()
    plain = run(gemv, kind, x, w, cfg).float()
    assert (plain[0, copies] == plain[0, best]).all()
    keys = ha.new_argmax_keys(1, DEV)
    logits, tok = head_token(kind, x, w, cfg, keys)
    assert torch.equal(logits, plain)
    assert tok == int(torch.argmax(plain)) == min([best, *copies])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("kind", ["q8_0", "dense"])
def test_all_negative_logits(kind, dtype):
    """Every logit below zero (negative weights, positive x), the best one tied at two indices."""
    cfg = CFGS["prefetch-split2"]
    w = weights(kind, N, K, dtype, seed=7)
    w = (-w[0].abs(), *w[1:])  # q8_0's int8 values or the dense weights; scales stay positive
    x = randn(1, K, dtype=dtype, seed=8).abs() + 0.01
    plain = run(gemv, kind, x, w, cfg).float()
    assert (plain < 0).all()
    best = int(torch.argmax(plain))
    for t in w:
        t[700] = t[best]
        t[5] = t[best]
    plain = run(gemv, kind, x, w, cfg).float()
    logits, tok = head_token(kind, x, w, cfg, ha.new_argmax_keys(1, DEV))
    assert torch.equal(logits, plain)
    assert tok == int(torch.argmax(plain)) == min(5, best)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the interpreter's NaN math
def test_negative_zero_ties_positive_zero_and_nan_wins():
    """fp16 logits: a tiny negative sum rounds to -0.0 (row 3), a tiny positive one to +0.0 (row
    9), every other row is negative: equal values, so the lower index, as torch.argmax. Then NaN
    rows (11 and 40): the first NaN, as torch.argmax. The dense GEMV, two programs, split K."""
    cfg = dict(BLOCK_N=32, BLOCK_G=1, SPLIT_K=2, num_warps=4)
    n, k, tiny = 50, 64, 2.0**-24  # fp16's smallest subnormal
    w = -torch.rand(n, k, generator=torch.Generator().manual_seed(1)) - 0.1
    w[3], w[9] = 0.0, 0.0
    w[3, 0], w[9, 1] = -tiny, tiny
    x = torch.rand(1, k, generator=torch.Generator().manual_seed(2)) + 0.1
    x[0, :2] = 1e-3
    w, x = w.to(torch.float16).to(DEV), x.to(torch.float16).to(DEV)
    plain = run(gemv, "dense", x, (w,), cfg).float()
    assert plain[0, 3] == 0 and plain[0, 3].signbit() and not plain[0, 9].signbit()
    logits, tok = head_token("dense", x, (w,), cfg, ha.new_argmax_keys(1, DEV))
    assert torch.equal(logits, plain) and tok == int(torch.argmax(plain)) == 3
    w[[40, 11], 5] = float("nan")
    logits = gemv("dense", x, (w,), cfg, keys := ha.new_argmax_keys(1, DEV))
    tok = int(ha.finish_argmax(keys, torch.empty(1, dtype=torch.int64, device=DEV))[0])
    assert logits[0, 11].isnan() and tok == int(torch.argmax(logits)) == 11


@triton.jit
def _keys_kernel(v_ptr, keys_ptr, n, BLOCK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # columns past n load NaN, which would win were they not masked
    v = tl.load(v_ptr + cols, mask=cols < n, other=float("nan"))
    tl.atomic_max(keys_ptr + tl.arange(0, 1), ha.max_keys(v[None, :], cols, n), sem="relaxed")


VECTORS = {
    "neg-zero-first": [-1.0, -0.0, 0.0, -2.0],
    "pos-zero-first": [-1.0, 0.0, -0.0, -0.0],
    "nan-first": [1.0, float("nan"), 3.0, float("nan")],
    "negative-nan": [1.0, 2.0, -float("nan"), float("inf")],
    "inf-ties": [float("inf"), 3.0, float("inf")],
    "all-neg-inf": [-float("inf")] * 5,
    "denormals": [-1e-45, 1e-45, 1e-45, 0.0],
}


@pytest.mark.parametrize("name", [*VECTORS, "random"])
def test_packed_keys_order_as_torch_argmax(name):
    """The key of max_keys (in a kernel, 4-column programs) and of argmax_keys (torch) decode to
    torch.argmax on hand-picked values; finish_argmax's kernel and reference agree."""
    if name == "random":
        v = torch.randn(37, generator=torch.Generator().manual_seed(0))
        v[[4, 30]] = v.max() + 1
    else:
        v = torch.tensor(VECTORS[name])
    v = v.to(DEV)
    want = int(torch.argmax(v))
    keys = ha.new_argmax_keys(3, DEV)
    _keys_kernel[(triton.cdiv(v.numel(), 4),)](v, keys, v.numel(), BLOCK=4)
    assert keys[0] == ha.argmax_keys(v[None, :])[0]
    assert ha.decode_keys(keys[:1]).item() == want
    assert (keys[1:] == ha.KEY_MIN).all()
    twin = keys.clone()
    twin[1] = keys[0] - 5  # a second batch row's slot
    out, out_ref = (torch.empty(2, dtype=torch.int64, device=DEV) for _ in range(2))
    ref_keys = twin.clone()
    ha.finish_argmax.ref(ref_keys, out_ref)
    ha._finish_argmax_op(twin, out)
    assert torch.equal(out, out_ref) and out[0] == want
    assert torch.equal(twin, ref_keys) and (twin == ha.KEY_MIN).all()


def test_pack_argmax_ref_keeps_the_larger_key():
    keys = ha.new_argmax_keys(2, DEV)
    ha.pack_argmax_ref(torch.tensor([[1.0, 5.0, 5.0]], device=DEV), keys)
    ha.pack_argmax_ref(torch.tensor([[4.0, 2.0]], device=DEV), keys)  # a smaller best
    assert ha.decode_keys(keys[:1]).item() == 1 and keys[1] == ha.KEY_MIN


def planted(n, k, seed):
    """fp32 weights [n, k] and x [1, k] whose row 517 (or n - 1) clearly wins."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed + 1))
    w[min(517, n - 1)] = x[0].sign() * 0.05
    return w.to(DEV), x.to(DEV), min(517, n - 1)


@pytest.mark.parametrize("scheme", [None, "q8_0", "affine4"])
def test_matmul_and_linear_entry_points(scheme, monkeypatch):
    """q8_0_matmul / affine_matmul / dense_gemv and the Linear layers at T = 1 with head_keys, on
    the kernels and on the references: fp32 logits (the reference's are its output .float()),
    the planted token, keys re-armed by finish_argmax."""
    from kipp_cuda.layers import make_linear
    from kipp_cuda.quant import quantize

    w, x32, best = planted(601, 256, seed=11)
    dense = {"weight": w.to(torch.bfloat16)}
    layer = make_linear(quantize(w, scheme) if scheme else dense, scheme)
    x = x32.to(torch.bfloat16)
    if scheme == "q8_0":
        fn, args = qm.q8_0_matmul, (layer.qs, layer.scales)
    elif scheme == "affine4":
        fn, args = am.affine_matmul, (layer.wq, layer.scales, layer.biases, 4, 32)
    else:
        fn, args = dg.dense_gemv, (layer.weight,)
    entries = {
        "op": lambda **kw: fn(x, *args, **kw),
        "layer": lambda **kw: layer(x, **kw),
    }
    got = {}
    for path in ("kernel", "ref"):
        if path == "kernel":
            monkeypatch.setenv("KIPP_CUDA_INTERPRET", "1")
            monkeypatch.delenv("KIPP_CUDA_DISABLE_KERNELS", raising=False)
        else:
            monkeypatch.setenv("KIPP_CUDA_DISABLE_KERNELS", "all")
        for name, entry in entries.items():
            keys = ha.new_argmax_keys(1, DEV)
            logits = run(entry, head_keys=keys)
            out = torch.empty(1, dtype=torch.int64, device=DEV)
            ha.finish_argmax(keys, out)
            assert logits.dtype == torch.float32 and logits.shape == (1, w.shape[0])
            assert int(out[0]) == best == int(torch.argmax(logits))
            assert (keys == ha.KEY_MIN).all()
            assert torch.equal(logits, entry().float())  # this path's plain output
            got[path, name] = logits
    assert torch.equal(got["ref", "op"], fn.ref(x, *args).float())
    close(got["kernel", "op"], got["ref", "op"], torch.bfloat16)


def test_head_keys_refuse_t_other_than_one_and_fused_swiglu():
    qs, d, _ = q8_weights(8, 64, seed=1)
    wq, s, b, _ = affine_weights(8, 64, 4, 32, seed=2, sdtype=torch.float32)
    wd = randn(8, 32, seed=3)
    keys = ha.new_argmax_keys(2, DEV)
    x1, x2 = randn(1, 64, seed=4), randn(2, 64, seed=5)
    for fn in (qm.q8_0_matmul, qm.q8_0_matmul.op, qm.q8_0_matmul.ref):
        with pytest.raises(ValueError, match="head_keys"):
            fn(x2, qs, d, head_keys=keys)
        with pytest.raises(ValueError, match="head_keys"):
            fn(x1, qs, d, swiglu=True, head_keys=keys)
    for fn in (am.affine_matmul, am.affine_matmul.op, am.affine_matmul.ref):
        with pytest.raises(ValueError, match="head_keys"):
            fn(x2, wq, s, b, 4, 32, head_keys=keys)
        with pytest.raises(ValueError, match="head_keys"):
            fn(x1, wq, s, b, 4, 32, swiglu=True, head_keys=keys)
    with pytest.raises(ValueError, match="head_keys"):
        qg.q8_0_gemv(x1, qs, d, swiglu=True, head_keys=keys)
    with pytest.raises(ValueError, match="head_keys"):
        ag.affine_gemv(x1, wq, s, b, 4, 32, swiglu=True, head_keys=keys)
    for fn in (dg._dense_gemv_op, dg.dense_gemv_ref):
        with pytest.raises(ValueError, match="head_keys"):
            fn(x1, wd, True, head_keys=keys)  # act
        with pytest.raises(ValueError, match="head_keys"):
            fn(x2[:, :32], wd, head_keys=keys)
    with pytest.raises(ValueError, match="head_keys"):
        qg.q8_0_gemv(x1, qs, d, head_keys=keys.int())
    from kipp_cuda.layers import DenseLinear, Q8Linear

    with pytest.raises(ValueError, match="head_keys"):
        DenseLinear(wd)(x2[:, :32], head_keys=keys)
    with pytest.raises(ValueError, match="head_keys"):
        Q8Linear(qs, d)(x1, swiglu=True, head_keys=keys)
    assert (keys == ha.KEY_MIN).all()


_COMPILE = """
import triton, triton.language as tl
from triton.compiler import ASTSource
from kipp_cuda.kernels import affine_gemv as ag, dense_gemv as dg, head_argmax as ha
from kipp_cuda.kernels import q8_0_gemv as qg
from kipp_cuda.kernels.sass import AFFINE_SIG, Q8_SIG, TARGET, _ordered

def ptx(fn, sig, consts):
    src = ASTSource(fn=fn, signature=_ordered(fn, sig), constexprs=consts)
    return triton.compile(src, target=TARGET, options=dict(num_warps=4)).asm["ptx"]

head = dict(out_ptr="*fp32", key_ptr="*i64")
q = dict(BLOCK_N=16, BLOCK_G=64, PDL=True, ASM=True, PREFETCH=False, INT_X=False, SWIGLU=False)
dense = dict(x_ptr="*bf16", w_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32", N="i32", K="i32",
             k_per_split="i32", stride_wn="i32", **head)
affine = dict(q, SPLIT_K=1, BITS=4, GROUP=32)
for name, fn, sig, consts in (
    ("q8_0", qg._q8_0_gemv_kernel, {**Q8_SIG, **head}, dict(q, SPLIT_K=3)),
    ("affine4", ag._affine_gemv_kernel, {**AFFINE_SIG, **head}, affine),
    ("dense", dg._dense_gemv_kernel, dense, dict(BLOCK_N=8, BLOCK_K=256, SPLIT_K=2, ACT=False)),
):
    text = ptx(fn, sig, dict(consts, HEAD=True, ROUND=tl.bfloat16, PDL=True))
    print(name, sum("max.s64" in line and ("red." in line or "atom." in line)
                    for line in text.splitlines()))
sig = dict(keys_ptr="*i64", out_ptr="*i64", B="i32")
ptx(ha._finish_argmax_kernel, sig, dict(BLOCK=4, PDL=True))
print("finish_argmax ok")
"""


@pytest.mark.skipif(not sass.available(), reason="this Triton ships no CUDA toolchain")
def test_head_mode_compiles_for_sm90_with_one_atomic_a_program():
    """The interpreter runs what the compiler refuses (a plain global in a jit function): the
    head-mode GEMVs and finish_argmax compiled for sm_90 (no GPU; a subprocess, as the tests here
    run the interpreter), each GEMV with one int64 max atomic."""
    lines = compile_offline(_COMPILE).split("\n")[:4]
    assert lines == ["q8_0 1", "affine4 1", "dense 1", "finish_argmax ok"]
