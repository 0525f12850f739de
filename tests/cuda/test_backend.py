"""The CUDA backend as a whole: Triton kernels inside the full model (CPU interpreter), weight
quantization at load, the q8_0 KV cache, KV budget errors, and tensor parallelism over gloo."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.checkpoint import Checkpoint
from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from oracle.qwen3 import forward, load_weights
from tests.conftest import logprob_atol, nmse, rel_err, small_config

torch = pytest.importorskip("torch")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(1000, 1030))
# TP=2 runs over gloo on CPU (CI) or NCCL on two GPUs; a one-GPU machine has neither by default.
one_gpu = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="TP=2 needs two GPUs when a GPU is visible (CI runs it over gloo on CPU)",
)
QUANT_NMSE = {"q8_0": 1.2e-3, "affine8": 1e-3, "affine4": 0.25}


def test_interpreted_kernels_in_the_full_model(tiny_path, monkeypatch):
    """Every Triton kernel (under the interpreter on CPU) inside the model equals the oracle."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the kernels run natively (tests/conformance)")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET must be set before the kernels are imported")
    monkeypatch.setenv("KIPP_CUDA_INTERPRET", "1")
    monkeypatch.setenv("KIPP_CUDA_REQUIRE_KERNELS", "1")  # any fallback fails the test
    llm = LLM(
        str(tiny_path), backend="cuda", dtype="float32", block_size=8, max_num_batched_tokens=16
    )  # chunked: the prefill kernel reads a cached prefix
    ref = LLM(str(tiny_path))
    assert rel_err(llm.logits(PROMPT), ref.logits(PROMPT)) <= 1e-5
    got = llm.generate([PROMPT], GREEDY)[0].token_ids
    assert got == ref.generate([PROMPT], GREEDY)[0].token_ids


@pytest.mark.parametrize("scheme", ["q8_0", "affine4", "affine8"])
def test_quantize_at_load_equals_stored_checkpoint(scheme, make_checkpoint, tmp_path):
    """--quant at load and `kipp quantize` on disk give the same weights, hence the same logits,
    and both equal the oracle on the dequantized checkpoint."""
    from kipp_core.quantize_checkpoint import quantize_checkpoint

    cfg = small_config(vocab_size=1024)
    src = make_checkpoint(cfg, seed=8, dtype="float32")
    quantize_checkpoint(Checkpoint(src), tmp_path / "q", scheme)
    ids = np.random.default_rng(0).integers(0, 1024, size=24).tolist()
    ref = forward(load_weights(Checkpoint(tmp_path / "q")), ids)
    at_load = LLM(str(src), backend="cuda", dtype="float32", quant=scheme).logits(ids)
    stored = LLM(str(tmp_path / "q"), backend="cuda", dtype="float32").logits(ids)
    np.testing.assert_array_equal(at_load, stored)
    assert rel_err(stored, ref) <= 1e-5
    # Stated bounds against the float model on these random weights (measured: q8_0 4.1e-4,
    # affine8 3.0e-4, affine4 9.7e-2): about 3x headroom.
    assert nmse(stored, forward(load_weights(Checkpoint(src)), ids)) <= QUANT_NMSE[scheme]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (bf16 GEMV kernels)")
@pytest.mark.parametrize("scheme", ["q8_0", "affine4"])
def test_gpu_int16_x_gemvs_in_the_model(scheme, make_checkpoint, tmp_path, monkeypatch):
    """The int16-x GEMVs (bits.py) inside a whole bf16 model. One token a chunk, so every position
    runs the one-token GEMVs over its cached context; the logits stay within the bf16 gate (NMSE
    1e-3) of the oracle on the dequantized checkpoint, with int16 x on and off."""
    from kipp_core.quantize_checkpoint import quantize_checkpoint

    src = make_checkpoint(small_config(vocab_size=1024), seed=8, dtype="float32")
    quantize_checkpoint(Checkpoint(src), tmp_path / "q", scheme)
    ids = np.random.default_rng(1).integers(0, 1024, size=40).tolist()
    ref = forward(load_weights(Checkpoint(tmp_path / "q")), ids)
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("KIPP_CUDA_INT_X", flag)
        llm = LLM(str(tmp_path / "q"), backend="cuda", dtype="bfloat16", max_num_batched_tokens=1)
        got[flag] = llm.logits(ids)
        assert nmse(got[flag], ref) <= 1e-3, flag
    assert not np.array_equal(got["0"], got["1"])  # the switch took a different path


def test_q8_0_kv_cache_bound_and_placement_invariance(tiny_path):
    f = LLM(str(tiny_path), backend="cuda", dtype="float32")
    q = LLM(str(tiny_path), backend="cuda", dtype="float32", kv_quant="q8_0")
    base = f.logits(PROMPT)
    a = q.logits(PROMPT)
    assert nmse(a, base) <= 1e-3
    # The same prompt in other blocks (after filling some) gives identical logits.
    q.generate([list(range(50, 120))], GREEDY)
    q.engine.block_manager.reset_prefix_cache()
    b = q.logits(PROMPT)
    np.testing.assert_array_equal(a, b)


def test_kv_cache_q8_0_is_smaller(tiny_path):
    from kipp_cuda.kv_cache import bytes_per_block

    cfg = Checkpoint(tiny_path).config
    ratio = bytes_per_block(cfg, 32, torch.bfloat16, None) / bytes_per_block(
        cfg, 32, torch.bfloat16, "q8_0"
    )
    assert 1.85 < ratio < 1.9


def test_kv_budget_too_small_names_sizes(tiny_path):
    with pytest.raises(
        ValueError,
        match=r"holds 32 tokens, less than one full-context request "
        r"of 4096 tokens",
    ):
        LLM(str(tiny_path), backend="cuda", num_kv_blocks=1)
    with pytest.raises(ValueError, match="kv_cache_memory must be a size like"):
        LLM(str(tiny_path), backend="cuda", kv_cache_memory="lots")


@one_gpu
def test_tensor_parallel_gloo_equals_single(tiny_path):
    """TP=2 over gloo (two processes on CPU): float32 logits and greedy tokens equal TP=1."""
    one = LLM(str(tiny_path), backend="cuda", dtype="float32")
    two = LLM(str(tiny_path), backend="cuda", dtype="float32", tensor_parallel=2)
    try:
        assert rel_err(two.logits(PROMPT), one.logits(PROMPT)) <= 1e-5
        ps = [PROMPT, list(range(7, 40))]
        assert [o.token_ids for o in two.generate(ps, GREEDY)] == [
            o.token_ids for o in one.generate(ps, GREEDY)
        ]
    finally:
        two.backend.close()


@one_gpu
def test_tensor_parallel_keeps_a_rope_scaling_override(tiny_path):
    """Every rank runs the config --rope-scaling made, not the checkpoint's own."""
    yarn = {"rope_type": "yarn", "factor": 2.0}
    one = LLM(str(tiny_path), backend="cuda", dtype="float32", rope_scaling=yarn)
    two = LLM(str(tiny_path), backend="cuda", dtype="float32", rope_scaling=yarn, tensor_parallel=2)
    try:
        assert rel_err(two.logits(PROMPT), one.logits(PROMPT)) <= 1e-5
        plain = LLM(str(tiny_path), backend="cuda", dtype="float32").logits(PROMPT)
        assert rel_err(two.logits(PROMPT), plain) > 1e-3  # YaRN changes every position
    finally:
        two.backend.close()


@one_gpu
def test_tensor_parallel_with_q8_0_weights_equals_single(tiny_path):
    one = LLM(str(tiny_path), backend="cuda", dtype="float32", quant="q8_0")
    two = LLM(str(tiny_path), backend="cuda", dtype="float32", quant="q8_0", tensor_parallel=2)
    try:
        assert rel_err(two.logits(PROMPT), one.logits(PROMPT)) <= 1e-5
    finally:
        two.backend.close()


DIES = """
import os, signal, sys, time
from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
llm = LLM(sys.argv[1], backend="cuda", dtype="float32", tensor_parallel=2)
print("pids", " ".join(str(p.pid) for p in llm.backend.procs), flush=True)
os.kill(llm.backend.procs[0].pid, signal.SIGKILL)
time.sleep(5)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))
print("not reached", flush=True)
"""


@one_gpu
def test_a_dead_worker_ends_the_process_with_a_clear_message(tiny_path):
    """No hang and no process left behind when a tensor-parallel worker dies."""
    import os
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-c", DIES, str(tiny_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert p.returncode != 0 and "not reached" not in p.stdout
    assert "tensor-parallel worker" in p.stderr and "died" in p.stderr
    pids = [int(x) for x in p.stdout.split("pids", 1)[1].split()]
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
def test_gpu_graph_paths_equal_eager(tiny_path):
    """Decode graphs (logits inside the graph) and single-sequence prefill graphs (padded to a
    bucket) give the eager model's float32 logits and greedy tokens, including a prefix-cache hit
    whose few new tokens run through the smallest prefill graph. The tiny model is launch-bound,
    so its buckets go up to 2,048 tokens (graph_sizes.prefill_buckets)."""
    from kipp_cuda.graph_sizes import LARGE_PREFILL_GRAPH_TOKENS, PREFILL_GRAPH_TOKENS

    graphs = LLM(str(tiny_path), backend="cuda", dtype="float32")
    eager = LLM(str(tiny_path), backend="cuda", dtype="float32", enforce_eager=True)
    runner = graphs.backend.runner
    assert runner.prefill_tokens == [*PREFILL_GRAPH_TOKENS, *LARGE_PREFILL_GRAPH_TOKENS]
    # graph buckets, their edges, and eager above them
    _graphs_equal_eager(graphs, eager, (1, 5, 16, 17, 100, 256, 300, 1024, 1500, 2048, 2100))


def _graphs_equal_eager(graphs, eager, sizes) -> None:
    """Logits of one prompt of each size, greedy tokens of three prompts, then a prompt-end hit
    (no layer runs) and a prefix hit whose 8 new tokens run through the 16-token graph."""
    for n in sizes:
        ids = list(range(500, 500 + n))
        assert rel_err(graphs.logits(ids), eager.logits(ids)) <= 1e-5
    prompts = [list(range(3, 3 + n)) for n in (40, 7, 90)]
    want = [o.token_ids for o in eager.generate(prompts, GREEDY)]
    assert [o.token_ids for o in graphs.generate(prompts, GREEDY)] == want
    again = graphs.generate(prompts[:1], GREEDY)[0]
    assert again.token_ids == want[0] and again.metrics.num_cached_tokens == 40
    other = prompts[0][:-1] + [999]
    got = graphs.generate([other], GREEDY)[0]
    assert got.token_ids == eager.generate([other], GREEDY)[0].token_ids
    assert got.metrics.num_cached_tokens == 32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (PDL, graphs)")
@pytest.mark.parametrize("quant", [None, "q8_0", "affine4"])
def test_gpu_pdl_decode_equals_plain_launches(tiny_path, monkeypatch, quant):
    """Programmatic dependent launch changes when kernels start, never what they compute: bf16
    decode through CUDA graphs gives the same tokens and logprobs, bit for bit, with it and
    without it (KIPP_CUDA_PDL=0), for dense and quantized weights."""
    from kipp_cuda.kernels.pdl import pdl_enabled

    if not pdl_enabled(torch.device("cuda")):
        pytest.skip("PDL needs sm_90 or newer")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    prompts = [list(range(3, 3 + n)) for n in (1, 37, 130)]
    with_pdl = LLM(str(tiny_path), backend="cuda", dtype="bfloat16", quant=quant)
    got = with_pdl.generate(prompts, params)
    monkeypatch.setenv("KIPP_CUDA_PDL", "0")
    assert not pdl_enabled(torch.device("cuda"))
    plain = LLM(str(tiny_path), backend="cuda", dtype="bfloat16", quant=quant)
    want = plain.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs


def test_pdl_is_off_without_a_hopper_gpu(monkeypatch):
    from kipp_cuda.kernels.pdl import launch_kwargs, pdl_enabled

    assert launch_kwargs(torch.device("cpu")) == {}
    monkeypatch.setenv("KIPP_CUDA_PDL", "0")
    assert not pdl_enabled(torch.device("cuda"))


class _ReplayByCalling:
    """Stands in for a CUDA graph on CPU: replay re-runs the captured function into the same
    output tensor, reading the runner's staged inputs as a graph would. It also does what the
    shared memory pool may do on a GPU: the buffers a graph frees at the end of its capture may
    hold the outputs of any graph captured after it, so replaying it can overwrite those (PyTorch
    shares a pool safely only between graphs replayed in capture order). Replay poisons them, so
    a runner that reads a graph's outputs after replaying one captured earlier fails here too."""

    def __init__(self, fn, out, runner=None):
        self.fn, self.out, self.later = fn, out, []
        self.own = set()  # runner buffers a graph writes in place: not the pool's
        if runner is not None:
            self.own = {runner.g_last.untyped_storage().data_ptr()}
            made = runner.__dict__.setdefault("_stand_ins", [])
            for g in made:
                g.later.append(self)
            made.append(self)

    def _outs(self):
        return self.out if isinstance(self.out, tuple) else (self.out,)

    def poison(self):
        for o in self._outs():
            if o.untyped_storage().data_ptr() not in self.own:
                o.fill_(float("nan") if o.is_floating_point() else -1)

    def replay(self):
        for g in self.later:
            g.poison()
        got = self.fn()  # a decode graph's (hidden, logits), a prefill graph's hidden
        for o, g in zip(self._outs(), got if isinstance(got, tuple) else (got,)):
            o.copy_(g)

    def pool(self):
        return None


def stand_in_capture(runner, fn, pool):
    """ModelRunner._capture on CPU: (a _ReplayByCalling, its output)."""
    out = fn()
    return _ReplayByCalling(fn, out, runner), out


def test_graph_staging_and_padding_equal_eager_on_cpu(tiny_path, monkeypatch):
    """The graph paths' input staging, padding and output slicing (decode batches padded to a
    bucket with slots of -1; one prefill padded with later queries) against the eager model,
    in float32 on CPU with the graphs replaced by re-running what they captured."""
    from kipp_cuda.runner import ModelRunner

    if torch.cuda.is_available():
        pytest.skip("on a GPU the real graphs run (test_gpu_graph_paths_equal_eager)")
    monkeypatch.setattr(ModelRunner, "_capture", stand_in_capture)
    staged = LLM(str(tiny_path), backend="cuda", dtype="float32", max_num_seqs=5)
    runner = staged.backend.runner
    runner.capture()
    assert runner.graph_bs == [1, 2, 4, 5] and runner.prefill_tokens[0] == 16
    eager = LLM(str(tiny_path), backend="cuda", dtype="float32", max_num_seqs=5)
    _graphs_equal_eager(staged, eager, (1, 5, 16, 17, 100))


def test_graph_staging_serves_scores_logprobs_and_drafts_on_cpu(tiny_path, monkeypatch):
    """Prompt scores, sampled-token logprobs and speculative verification (several rows of one
    sequence through a padded prefill graph) equal the eager runner's."""
    from kipp_cuda.runner import ModelRunner

    if torch.cuda.is_available():
        pytest.skip("on a GPU the real graphs run (test_gpu_graph_paths_equal_eager)")
    monkeypatch.setattr(ModelRunner, "_capture", stand_in_capture)
    kw = dict(backend="cuda", dtype="float32", max_num_seqs=4)
    staged = LLM(str(tiny_path), **kw, speculative="ngram", num_speculative_tokens=3)
    staged.backend.runner.capture()
    eager = LLM(str(tiny_path), **kw, speculative="ngram", num_speculative_tokens=3)
    prompt = list(range(20, 40)) * 3  # repeats: the n-gram proposer drafts
    a, b = staged.score(prompt, top_n=2)[0], eager.score(prompt, top_n=2)[0]
    assert a[0] is None and b[0] is None
    assert [x.token_id for x in a[1:]] == [x.token_id for x in b[1:]]
    # padded graph rows and eager rows: float32 sums in other orders (tests.conftest)
    cfg = staged.config
    terms = max(cfg.intermediate_size, cfg.hidden_size) + len(prompt) + 12
    tol = logprob_atol(np.abs(eager.logits(prompt)).max(), terms, cfg.vocab_size)
    assert np.allclose([x.logprob for x in a[1:]], [x.logprob for x in b[1:]], atol=tol)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    x, y = staged.generate([prompt], p)[0], eager.generate([prompt], p)[0]
    assert x.token_ids == y.token_ids
    xl, yl = x.outputs[0].logprobs, y.outputs[0].logprobs
    assert len(xl) == 12 and np.allclose([t.logprob for t in xl], [t.logprob for t in yl], atol=tol)
