"""Shared pieces of the kernel tests: where they run, poisoned allocations, the op tolerances, and
a paged KV context built independently of kv_write (with a float64 attention over it)."""

from __future__ import annotations

import contextlib
import itertools
import math
import os

import pytest
import torch

from kipp_core.quant import dequantize_q8_0, quantize_q8_0

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["f32", "f16", "bf16"]
DTYPE_IDS = dict(zip(IDS, DTYPES))  # an axis of cases()
# Op vs ref: the same arithmetic up to reduction order, except that the CPU interpreter rounds
# float32 -> bfloat16 toward zero (1 ulp); each output is rounded to the dtype at most twice.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def skip_unless_runnable() -> None:
    """Kernel tests run on a GPU, or on CPU under Triton's interpreter (tests/cuda/conftest.py)."""
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)


def cases(strength: int = 2, **axes) -> list:
    """pytest.params over the named axes (each a list of values, or a dict of id -> value). On a
    GPU: every combination. Under Triton's interpreter, where a case costs seconds: a subset that
    holds every `strength`-tuple of values of `strength` axes at least once (2: every pair of
    values; 1: every value), chosen greedily, the same on every run."""
    named = [
        list(v.items()) if isinstance(v, dict) else [(str(x), x) for x in v] for v in axes.values()
    ]
    combos = list(itertools.product(*[range(len(v)) for v in named]))
    if not HAS_CUDA:
        groups = list(itertools.combinations(range(len(named)), strength))

        def tuples(c):
            return {(g, tuple(c[i] for i in g)) for g in groups}

        todo, keep = set().union(*map(tuples, combos)), []
        while todo:
            best = max(combos, key=lambda c: len(tuples(c) & todo))
            keep.append(best)
            todo -= tuples(best)
        combos = sorted(keep)

    def param(c):
        values = [named[a][i][1] for a, i in enumerate(c)]
        return pytest.param(*values, id="-".join(named[a][i][0] for a, i in enumerate(c)))

    return [param(c) for c in combos]


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


class Paged:
    """Dense per-sequence K/V (as stored: dequantized for q8) and the same in a shuffled paged
    cache; every cache position outside a context is NaN (the scale, for q8)."""

    def __init__(self, ctx_lens, hkv, d, page, dtype, q8=False, seed=0, device=DEV, spare_blocks=3):
        g = torch.Generator().manual_seed(seed)
        self.ctx_lens = list(ctx_lens)
        need = [math.ceil(n / page) for n in ctx_lens]
        num_blocks = sum(need) + spare_blocks
        max_blocks = max(need + [1]) + 2  # padding columns past every sequence's end
        perm = torch.randperm(num_blocks, generator=g)
        poison_block = int(perm[-1])  # never owned: tables' padding points here
        shape = (num_blocks, page, hkv, d)
        if q8:
            kc = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
            vc = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
            ks = torch.full((*shape[:3], d // 32), float("nan"), dtype=torch.float16)
            vs = ks.clone()
        else:
            kc = torch.full(shape, float("nan"), dtype=dtype)
            vc = kc.clone()
            ks = vs = None
        bt = torch.full((len(ctx_lens), max_blocks), poison_block, dtype=torch.int32)
        self.k, self.v = [], []  # dense float64 [n, hkv, d]
        used = 0
        for b, n in enumerate(ctx_lens):
            blocks = perm[used : used + need[b]]
            used += need[b]
            bt[b, : need[b]] = blocks.to(torch.int32)
            pos = torch.arange(n)
            blk, off = blocks[pos // page], pos % page
            kv = []
            for cache, scale in ((kc, ks), (vc, vs)):
                x = torch.randn(n, hkv, d, generator=g)
                if q8 and n:
                    qs, dd = quantize_q8_0(x.numpy())  # kipp_core's numpy q8_0, the outside ref
                    cache[blk, off] = torch.from_numpy(qs)
                    scale[blk, off] = torch.from_numpy(dd)
                    kv.append(torch.from_numpy(dequantize_q8_0(qs, dd)).double())
                elif q8:
                    kv.append(x.double())
                else:
                    cache[blk, off] = x.to(dtype)
                    kv.append(x.to(dtype).double())
            self.k.append(kv[0])
            self.v.append(kv[1])
        to = dict(device=device)
        self.k_cache, self.v_cache = kc.to(**to), vc.to(**to)
        self.k_scale = None if ks is None else ks.to(**to)
        self.v_scale = None if vs is None else vs.to(**to)
        self.block_tables = bt.to(**to)
        self.context_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)

    def cache_args(self):
        return self.k_cache, self.v_cache

    def scales(self):
        return self.k_scale, self.v_scale


def naive_attention(q, p: Paged, q_lens, scale):
    """float64 causal attention over the dense K/V: q [T, Hq, D] -> [T, Hq, D]."""
    q = q.double().cpu()
    out = torch.zeros_like(q)
    t0 = 0
    for b, lq in enumerate(q_lens):
        n = p.ctx_lens[b]
        kv_head = torch.arange(q.shape[1]) // (q.shape[1] // p.k[b].shape[1])
        k, v = p.k[b][:, kv_head], p.v[b][:, kv_head]  # [n, Hq, D]
        s = torch.einsum("qhd,nhd->hqn", q[t0 : t0 + lq], k) * scale
        q_pos = torch.arange(n - lq, n)
        s[:, torch.arange(n)[None, :] > q_pos[:, None]] = float("-inf")
        out[t0 : t0 + lq] = torch.einsum("hqn,nhd->qhd", torch.softmax(s, dim=-1), v)
        t0 += lq
    return out


def compile_offline(script: str) -> str:
    """Run `script` in a fresh Python without Triton's interpreter (which the tests here run
    under), where it can compile kernels for sm_90 with the wheel's toolchain; its stdout."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
