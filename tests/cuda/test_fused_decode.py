"""The one-launch decode (kernels/fused_decode.py, KIPP_CUDA_FUSED_DECODE=1) against the two
launches it replaces (qk_norm_rope_kv_write, then paged_decode_attention): the same output and
the same cache after the call. Under the interpreter both run the same numpy sums, so they agree
bit for bit; a GPU may round the q/k norm's sum differently in its last bit (the two kernels
reduce over different layouts), so there one rounding is allowed. Caches hold NaN outside every
context and in each new token's slot before the call, outputs are born NaN."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from kipp_cuda.kernels import decode_attention as dec
from kipp_cuda.kernels import fused_decode as fd
from kipp_cuda.kernels import sass
from kipp_cuda.kernels import split_merge as sm
from kipp_cuda.kernels.qk_norm_rope import _qk_norm_rope_kv_write_op, rope_cos_sin_cache
from tests.cuda.kernel_testing import (
    DEV,
    HAS_CUDA,
    Paged,
    compile_offline,
    poisoned_empty,
    skip_unless_runnable,
)
from tests.cuda.test_attention_kernels import IDS, assert_close

skip_unless_runnable()

# Context 1, page (16) and tile (64) boundaries and one past them, a ragged tail, a long run
# whose last split has whole tiles before the new token's, and two empty slots: padding (slot
# -1) and an empty context with a live slot (the two-launch path stores it; so must this).
CTX = [1, 16, 33, 64, 65, 128, 129, 500, 0, 0]


class Step:
    """One decode step's inputs: qkv, norms, positions ctx - 1, the new tokens' slots from the
    block tables (poisoned), over a Paged context."""

    def __init__(self, dtype, G, ctx=CTX, hkv=2, d=32, page=16, seed=0, empty_live_slot=False):
        self.p = Paged(ctx, hkv, d, page, dtype, seed=seed)
        self.empty_live_slot = empty_live_slot  # the last row: context 0, a slot in a spare block
        g = torch.Generator().manual_seed(seed + 1)
        self.hq, self.d, B = G * hkv, d, len(ctx)
        self.qkv = (torch.randn(B, (self.hq + 2 * hkv) * d, generator=g) * 2).to(dtype).to(DEV)
        self.qw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEV)
        self.kw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEV)
        self.cos_sin = rope_cos_sin_cache(1024, d, 1e6, DEV)
        self.scale = 1 / math.sqrt(d)
        self.restage(ctx)

    def restage(self, ctx):
        p = self.p
        p.context_lens.copy_(torch.tensor(ctx, dtype=torch.int32))
        self.pos = (p.context_lens.long() - 1).clamp(min=0)
        page = p.k_cache.shape[1]
        blk = p.block_tables.long().gather(1, (self.pos // page)[:, None])[:, 0]
        self.slots = torch.where(p.context_lens > 0, blk * page + self.pos % page, -1)
        if self.empty_live_slot:
            spare = sorted(set(range(p.k_cache.shape[0])) - set(p.block_tables.flatten().tolist()))
            self.slots[-1] = spare[0] * page + 3
        live = self.slots[self.slots >= 0]
        for c in (p.k_cache, p.v_cache):
            c.view(-1, *c.shape[2:])[live] = float("nan")

    def caches(self):
        return self.p.k_cache.clone(), self.p.v_cache.clone()

    def two_launches(self, kc, vc, **kw):
        with poisoned_empty():
            q = _qk_norm_rope_kv_write_op(
                self.qkv, self.qw, self.kw, self.pos, self.cos_sin, self.hq, kc.shape[2],
                self.d, 1e-6, self.slots, kc, vc,
            )  # fmt: skip
            return dec._paged_decode_attention_op(
                q, kc, vc, self.p.block_tables, self.p.context_lens, self.scale, **kw
            )

    def fused(self, kc, vc, op=fd._paged_decode_attention_qkv_op, **kw):
        with poisoned_empty():
            return op(
                self.qkv, self.qw, self.kw, self.pos, self.cos_sin, self.hq, 1e-6, self.slots, kc,
                vc, self.p.block_tables, self.p.context_lens, self.scale, **kw,
            )  # fmt: skip


def assert_same(got, want, output=False):
    """Bit for bit under the interpreter (NaNs too). On a GPU, a cache within one rounding, and an
    attention output within one rounding of its largest element: a q element one rounding off
    moves every output of its head by about that much of the output's scale."""
    if HAS_CUDA:
        eps = torch.finfo(want.dtype).eps
        atol = eps * want[want.isfinite()].abs().max().item() if output else 1e-6
        torch.testing.assert_close(got, want, rtol=2 * eps, atol=atol, equal_nan=True)
    else:
        assert torch.equal(got.cpu().view(torch.uint8), want.cpu().view(torch.uint8))


def _compare(step, dtype, **kw):
    kc, vc = step.caches()
    want = step.two_launches(kc, vc, **kw)
    fkc, fvc = step.caches()
    got = step.fused(fkc, fvc, **kw)
    assert torch.isfinite(got).all(), "an output element was left unwritten (or read poison)"
    assert_same(got, want, output=True)
    assert_same(fkc, kc)
    assert_same(fvc, vc)
    assert torch.equal(fvc.cpu().view(torch.uint8), vc.cpu().view(torch.uint8))  # v is copied
    assert not fkc.view(-1, *fkc.shape[2:])[step.slots[step.slots >= 0]].isnan().any()
    step.p.k_cache, step.p.v_cache = kc, vc  # the cache as the step left it
    return got


def _counters_zeroed():
    return all(not c.any() for c in sm._COUNTERS.get(torch.device(DEV), []))


# (dtype, G, num_splits, FUSED_PREFETCH_KV): GQA 2 to 8, one split (a batch launch, no
# prefetch), and 2-8 splits of one tile or more (500 / 2 splits: four tiles a split)
CASES = [
    (torch.float32, 2, 1, True),
    (torch.float32, 3, 3, True),
    (torch.float32, 8, 2, False),
    (torch.bfloat16, 2, 8, False),
    (torch.bfloat16, 4, 2, True),
    (torch.bfloat16, 5, 1, True),
    (torch.bfloat16, 6, 3, False),
    (torch.bfloat16, 7, 4, True),
    (torch.float16, 8, 3, True),
]


@pytest.mark.parametrize(
    "dtype, G, num_splits, prefetch", CASES, ids=[f"{IDS[c[0]]}-G{c[1]}-s{c[2]}" for c in CASES]
)
def test_fused_equals_two_launches(dtype, G, num_splits, prefetch, short_splits, monkeypatch):
    monkeypatch.setattr(fd, "FUSED_PREFETCH_KV", prefetch)
    step = Step(dtype, G, seed=G, empty_live_slot=True)
    got = _compare(step, dtype, max_context_len=max(CTX), num_splits=num_splits)
    assert (got[-2:] == 0).all()  # empty contexts give zeros
    kc, vc = step.caches()
    ref = fd.paged_decode_attention_qkv_ref(
        step.qkv, step.qw, step.kw, step.pos, step.cos_sin, step.hq, 1e-6, step.slots, kc, vc,
        step.p.block_tables, step.p.context_lens, step.scale,
    )  # fmt: skip
    assert_close(got, ref, dtype)
    assert _counters_zeroed()


@pytest.mark.parametrize("fused_merge", [True, False], ids=["fused-merge", "merge-kernel"])
def test_fused_repeated_calls_as_graph_replays(fused_merge, short_splits):
    # Two steps into the same split counters and buffers, as two replays of one graph: the same
    # split count, new contexts (each one token on, one now empty), new slots poisoned again.
    step = Step(torch.bfloat16, 4, ctx=[63, 64, 1, 200, 0], seed=21)
    kw = dict(max_context_len=256, num_splits=5, fused_merge=fused_merge)
    _compare(step, torch.bfloat16, **kw)
    step.restage([64, 65, 2, 0, 0])
    _compare(step, torch.bfloat16, **kw)
    assert _counters_zeroed()


def test_fused_head_dim_128_through_dispatch(monkeypatch):
    monkeypatch.setenv("KIPP_CUDA_INTERPRET", "1")  # the kernel on CPU, not its reference
    step = Step(torch.float16, 4, ctx=[1, 97, 200], hkv=1, d=128, page=32, seed=5)
    kc, vc = step.caches()
    got = step.fused(kc, vc, op=fd.paged_decode_attention_qkv)  # the default split count
    ref = step.two_launches(*step.caches())
    assert_close(got, ref, torch.float16)
    assert_same(got, ref, output=True)


def test_fused_rejects_a_q8_cache_and_prefill_rows():
    step = Step(torch.float32, 2, ctx=[5, 9], seed=3)
    q8 = torch.zeros(step.p.k_cache.shape, dtype=torch.int8, device=DEV)
    with pytest.raises(ValueError, match="k_scale"):
        step.fused(q8, q8.clone())
    step.qkv = step.qkv[:1]  # one row for two sequences
    with pytest.raises(ValueError):
        step.fused(*step.caches())


# -- the switch -----------------------------------------------------------------------------


def test_switch_is_read_per_call_and_off_by_default(monkeypatch):
    monkeypatch.delenv("KIPP_CUDA_FUSED_DECODE", raising=False)
    assert not fd.fused_decode_enabled()
    for value, on in (("1", True), ("0", False), (" true ", True), ("", False)):
        monkeypatch.setenv("KIPP_CUDA_FUSED_DECODE", value)
        assert fd.fused_decode_enabled() is on


def test_tiny_model_decode_with_the_switch_equals_without(tiny_path, monkeypatch):
    """Greedy decode of the tiny model (float32, the kernels under the interpreter): the same
    tokens and logprobs, bit for bit, with KIPP_CUDA_FUSED_DECODE=1 as without, and the fused
    launch really taken. Tiles of 16 positions, so that a batch of two decodes with two splits
    (one of them empty for the shorter sequence)."""
    import kipp_cuda.attention as attention_mod
    from kipp_core.llm import LLM
    from kipp_core.sampling import SamplingParams

    if HAS_CUDA:
        pytest.skip("on a GPU: test_gpu_fused_decode_in_the_model")
    monkeypatch.setenv("KIPP_CUDA_INTERPRET", "1")
    monkeypatch.setenv("KIPP_CUDA_REQUIRE_KERNELS", "1")  # any fallback to a reference fails
    monkeypatch.setattr(dec, "BLOCK_N", 16)
    calls = []
    real = attention_mod.paged_decode_attention_qkv
    monkeypatch.setattr(
        attention_mod,
        "paged_decode_attention_qkv",
        lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k),
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    prompts = [list(range(1000, 1020)), list(range(7, 14))]
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("KIPP_CUDA_FUSED_DECODE", flag)
        llm = LLM(str(tiny_path), backend="cuda", dtype="float32", block_size=8)
        outs[flag] = llm.generate(prompts, params)
        assert bool(calls) == (flag == "1")
    for a, b in zip(outs["0"], outs["1"]):
        assert a.token_ids == b.token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


# -- GPU: Qwen3-8B heads, PDL, CUDA graphs ---------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("case", ["b1-2100", "ragged", "b64-one-split"])
def test_gpu_fused_decode_8b_heads(case, graph):
    # 32/8 heads of 128 in bf16, PDL where the GPU has it: batch 1 at 2,100 (the 8B step's split
    # config), a ragged batch (the new token first in a split, last in a tile, alone in one, at
    # 1), and 64 sequences (one split, no prefetch). The new tokens' slots are poisoned with NaN
    # before every step; output and cache against the two launches'.
    from kipp_cuda.kernels.qk_norm_rope import qk_norm_rope_kv_write
    from tests.cuda.test_attention_kernels_gpu import _gpu_paged

    ctx = {
        "b1-2100": [2100],
        "ragged": [2100, 1, 64, 65, 129, 2048, 4097],
        "b64-one-split": [1000 + 37 * i for i in range(64)],
    }[case]
    hq, hkv, d = 32, 8, 128
    kc, vc, _, _, bt, lens = _gpu_paged(ctx, hkv, seed=12)
    B, top = len(ctx), max(ctx)
    pos = lens.long() - 1
    slots = bt.long().gather(1, (pos // 32)[:, None])[:, 0] * 32 + pos % 32
    cos_sin = rope_cos_sin_cache(8192, d, 1e6, "cuda")
    qn = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    kn = torch.rand(d, device="cuda", dtype=torch.bfloat16) + 0.5
    qkv = torch.randn(B, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    fkc, fvc = kc.clone(), vc.clone()
    q = qk_norm_rope_kv_write(qkv, qn, kn, pos, cos_sin, hq, hkv, d, 1e-6, slots, kc, vc)
    want = dec.paged_decode_attention(q, kc, vc, bt, lens, d**-0.5, max_context_len=top)

    def step():
        return fd.paged_decode_attention_qkv(
            qkv, qn, kn, pos, cos_sin, hq, 1e-6, slots, fkc, fvc, bt, lens, d**-0.5,
            max_context_len=top,
        )  # fmt: skip

    out = step()  # warm-up (and the split counters, before capture)
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = step()
    for _ in range(10):
        for c in (fkc, fvc):
            c.view(-1, hkv, d)[slots] = float("nan")
        if graph:
            g.replay()
        else:
            out = step()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert_same(out, want, output=True)
        assert_same(fkc, kc)
        assert torch.equal(fvc.view(torch.int16), vc.view(torch.int16))
    assert _counters_zeroed()


@gpu
def test_gpu_fused_decode_in_the_model(tiny_path, monkeypatch):
    """bf16 decode of the tiny model through CUDA graphs (and PDL on Hopper) with
    KIPP_CUDA_FUSED_DECODE=1 as without: the same tokens, logprobs within bf16 rounding."""
    from kipp_core.llm import LLM
    from kipp_core.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    prompts = [list(range(3, 3 + n)) for n in (1, 37, 130)]
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("KIPP_CUDA_FUSED_DECODE", flag)
        outs[flag] = LLM(str(tiny_path), backend="cuda", dtype="bfloat16").generate(prompts, params)
    for a, b in zip(outs["0"], outs["1"]):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 2e-2


# -- compiled for sm_90 offline -------------------------------------------------------------

_COMPILE = """
import json
from kipp_cuda.kernels import sass
from scripts.attention_regs import launches
out = {}
for name, cap in launches().items():
    if name.startswith("fused"):
        kernel = sass.compile_launch(cap, PDL=True)
        out[name] = dict(sass.resources(kernel), ttir=kernel.asm["ttir"])
print(json.dumps(out))
"""


def _before_the_wait(ttir: str):
    # The kernel's TTIR up to its PDL wait (straight-line code): each load with whether its
    # pointer derives from qkv_ptr, and any store or atomic
    body = ttir.split("tt.func public @_fused_decode_kernel")[1]
    head = re.split(r"tt\.grid_dependency_wait|griddepcontrol\.wait", body, maxsplit=1)
    assert len(head) == 2, "no PDL wait"  # (an op of its own; inline asm in Triton 3.6)
    head = head[0].splitlines()[1:-1]  # (the signature's tail; the wait's line)
    tainted, loads = {"%qkv_ptr"}, []
    for line in head:
        m = re.match(r"\s*(%\w+)(?::\d+)? = (\S+)(.*)", line)
        if m:
            lhs, op, rest = m.groups()
            from_qkv = bool(set(re.findall(r"%\w+", rest)) & tainted)
            if from_qkv:
                tainted.add(lhs)
            if op == "tt.load":
                loads.append((rest.rsplit(":", 1)[-1].strip(), from_qkv))
    writes = [w for line in head for w in re.findall(r"tt\.(?:store|atomic\w*)", line)]
    return loads, writes


@pytest.mark.skipif(not sass.available(), reason="this Triton ships no CUDA toolchain")
def test_fused_kernel_at_the_8b_split_config_keeps_pdl_order_and_does_not_spill():
    """The launch of 8B batch-1 decode (32/8 heads of 128, bf16, an H200's split count) compiled
    for sm_90 as Triton specializes it (scripts/attention_regs.py): before the PDL wait nothing
    is stored and nothing read from qkv; the K/V tile loads go before it only with
    FUSED_PREFETCH_KV; no register spills either way."""
    got = json.loads(compile_offline(_COMPILE))
    for name, prefetch in (("fused prefetch=1", True), ("fused prefetch=0", False)):
        r = got[name]
        assert r["stack"] == 0 and r["spill_stores"] == 0, (name, r["regs"], r["stack"])
        loads, writes = _before_the_wait(r["ttir"])
        assert loads and not writes and not any(from_qkv for _, from_qkv in loads), name
        tiles = [t for t, _ in loads if t.startswith("tensor<64x128x")]
        assert len(tiles) == (2 if prefetch else 0), (name, tiles)
