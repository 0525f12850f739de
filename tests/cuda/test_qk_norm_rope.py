"""The RoPE tables (default and YaRN) against the oracle and transformers, and qk_norm_rope (q/k
RMSNorm, RoPE, and with it the KV write) against float64 references. On CPU the kernels run under
TRITON_INTERPRET=1 at small, awkward shapes; the tests marked gpu run Qwen3 shapes on CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kipp_cuda.kernels import kv_write as kvw
from kipp_cuda.kernels import qk_norm_rope as qr
from oracle.qwen3 import rope_cos_sin
from tests.cuda.kernel_testing import DEV, DTYPES, IDS, close, gen, randn, run, skip_unless_runnable

skip_unless_runnable()


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
