"""The graph runner's input staging on CPU, with the CUDA graphs stood in for by re-running what
they captured: one staged byte buffer (int64 rows, int32 contexts, int32 block tables), and the
steady state's PENDING ids taken by the decode graph itself from g_last, where the last step's
samples always are. Async scheduling through these graphs must equal the eager runner's loop."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.backend import PENDING
from kipp_core.sampling import SamplingParams
from tests.conftest import f32_paths_atol
from tests.cuda.test_backend import stand_in_capture

torch = pytest.importorskip("torch")

P = SamplingParams
GREEDY = P(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture
def staged(llm_factory, monkeypatch):
    """staged(**kw) -> an LLM on the cuda backend whose runner has CPU stand-in graphs. By
    default 8 sequences at most (decode graphs of 1, 2, 4 and 8 rows) and prefill graphs up to
    256 tokens: a stand-in capture runs its forward twice on the CPU, and the default 256
    sequences' 20 decode sizes and the 2,048-token buckets cost seconds a test that no test here
    reaches (large_buckets=True keeps those buckets)."""
    from kipp_cuda.runner import ModelRunner

    if torch.cuda.is_available():
        pytest.skip("on a GPU the real graphs run (test_backend.test_gpu_graph_paths_equal_eager)")
    monkeypatch.setattr(ModelRunner, "_capture", stand_in_capture)

    def make(large_buckets=False, **kw):
        if not large_buckets:
            monkeypatch.setenv("KIPP_CUDA_PREFILL_GRAPH_MAX", "256")
        kw.setdefault("max_num_seqs", 8)
        llm = llm_factory("cuda", dtype="float32", block_size=8, **kw)
        llm.engine.backend.runner.capture()
        return llm

    return make


def _prompts(n: int) -> list[list[int]]:
    return [[(29 * i + 13 * j) % 200 + 3 for j in range(6 + 5 * i)] for i in range(n)]


def _spy_replays(runner):
    """Record every graph replay: (kind, pending as _pending gave it, the FROM row it staged,
    the PENDING fills it queued on the device)."""
    from kipp_cuda.runner import FROM

    seen = []
    replay, fill = runner._replay, runner._fill_pending

    def spy_replay(key, pending, *args):
        seen.append({"key": key, "pending": pending, "fills": []})
        out = replay(key, pending, *args)
        seen[-1]["from"] = runner.inputs.h_in_np[FROM, : key[1]].copy()
        return out

    def spy_fill(ids, pending):
        if pending is not None and seen:
            seen[-1]["fills"].append(pending)
        return fill(ids, pending)

    runner._replay, runner._fill_pending = spy_replay, spy_fill
    return seen


def test_async_decode_graphs_equal_the_eager_loop(staged, llm_factory):
    """Greedy rows of different lengths (one finishing shifts the rows) beside a seeded sampled
    row: token for token the eager runner's synchronous loop; steady steps queue no fill."""
    params = [
        P(temperature=0, max_tokens=9, ignore_eos=True),
        P(temperature=0, max_tokens=4, ignore_eos=True),  # finishes first: the rows shift
        P(temperature=0.8, seed=3, max_tokens=8, ignore_eos=True),
        P(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    prompts = _prompts(len(params))
    eager = llm_factory("cuda", dtype="float32", block_size=8, async_scheduling=False)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    llm = staged()
    runner = llm.engine.backend.runner
    seen = _spy_replays(runner)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    from kipp_cuda.pending import in_order

    decodes = [r for r in seen if r["key"][0] == "decode" and r["pending"] is not None]
    steady = [r for r in decodes if in_order(r["pending"])]
    other = [r for r in decodes if not in_order(r["pending"])]
    assert len(steady) >= 5 and other, "the batch never ran both kinds of pending steps"
    for r in steady:  # the graph takes g_last's ids itself: nothing queued between
        k = len(r["pending"][0])
        assert r["fills"] == [] and r["from"][:k].all() and not r["from"][k:].any()
    for r in other:  # filled before the replay, by index; the graph takes the staged ids
        assert r["fills"] == [r["pending"]] and not r["from"].any()
    assert runner._last_tokens is None or runner._last_in_place()


def test_graphs_read_int32_contexts_from_one_upload_a_step(staged, monkeypatch):
    """The decode graphs read the int32 context view of the staged buffer (no cast kernel), and
    each replay uploads one prefix of the host buffer: up to the last block-table row it filled
    (with the resident decode inputs off: test_resident_decode.py has the replays that skip it)."""
    monkeypatch.setenv("KIPP_CUDA_RESIDENT_DECODE", "0")
    llm = staged(max_num_seqs=4)
    runner = llm.engine.backend.runner
    metas, replays, uploads = [], [], []
    model_forward, replay = runner.model.forward, runner._replay

    def spy_forward(ids, positions, kv, meta, *rest):
        metas.append(meta)
        return model_forward(ids, positions, kv, meta, *rest)

    def spy_replay(key, pending, ids, *args):
        replays.append(len(ids) if key[0] == "decode" else 1)  # block-table rows it fills
        return replay(key, pending, ids, *args)

    copy = torch.Tensor.copy_
    stage = runner.inputs.g_stage
    g_stage = stage.untyped_storage().data_ptr()

    def spy_copy(dst, src, *a, **kw):
        if dst.untyped_storage().data_ptr() == g_stage and src.dtype == torch.uint8:
            uploads.append((dst.data_ptr() - stage.data_ptr(), dst.nbytes, src.dtype))
        return copy(dst, src, *a, **kw)

    runner.model.forward, runner._replay = spy_forward, spy_replay
    monkeypatch.setattr(torch.Tensor, "copy_", spy_copy)
    out = llm.generate(_prompts(3), GREEDY)
    monkeypatch.undo()
    assert [len(o.token_ids) for o in out] == [3, 3, 3]
    decode = [m for m in metas if m.is_decode]
    assert decode and all(
        m.context_lens.dtype == torch.int32
        and m.context_lens.data_ptr() == runner.g_ctx.data_ptr()
        and m.block_tables.data_ptr() == runner.g_bt.data_ptr()
        for m in decode
    )
    # One copy a replay, of the bytes up to the end of the b-th block-table row (no device
    # copy of the steady state's PENDING ids either: the graph takes them from g_last).
    row = 4 * runner.max_blocks
    assert uploads == [(0, runner.inputs.bt_at + b * row, torch.uint8) for b in replays]
    assert 3 in replays


def test_a_prompt_end_hit_beside_the_last_hits_pending_token(staged, llm_factory):
    """A hit's sample comes from the head graph's own buffer; the next step's hit replays that
    graph again before the first sequence's PENDING id is read. g_last keeps the first's."""
    a, b = _prompts(3)[1:]
    llm = staged()
    if not llm.engine.backend.num_hidden_slots:
        pytest.skip("no prompt-end hidden states")
    eng = llm.engine
    llm.generate([a, b], GREEDY)  # saves both prompts' last hidden states
    runner = eng.backend.runner
    seen = _spy_replays(runner)
    inputs = []
    execute_async = eng.backend.execute_async

    def spy(batch):
        inputs.append(batch)
        return execute_async(batch)

    eng.backend.execute_async = spy
    eng.add_request("a", a, GREEDY)
    eng.step()
    eng.add_request("b", b, GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    both = [
        x
        for x in inputs
        if any(s.cached_hidden is not None for s in x.seqs)
        and any(PENDING in s.token_ids for s in x.seqs)
    ]
    assert both, "no step held a hit beside a PENDING decode"
    assert any(r["key"][0] == "decode" and np.asarray(r["from"]).any() for r in seen)
    ref = llm_factory("cuda", dtype="float32", block_size=8, enable_prefix_caching=False)
    want = [o.token_ids for o in ref.generate([a, b], GREEDY)]
    assert [done["a"], done["b"]] == want


def test_one_sequence_staged_on_its_own_blocks():
    """GraphInputs.stage_one_sequence (the graph-replay scripts' context): 70 tokens of 32-token
    blocks sit on blocks 0, 1, 2, the last token at position 69; the rest of the table and the
    other row stay as they were."""
    from kipp_cuda.staging import POS, GraphInputs

    gi = GraphInputs(rows=4, n=2, max_blocks=8, device=torch.device("cpu"))
    gi.stage_one_sequence(70, 32)
    assert int(gi.g_ctx[0]) == 70 and int(gi.g_in[POS, 0]) == 69
    assert gi.g_bt[0].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    gi.g_bt[1] = 5
    gi.stage_one_sequence(65, 16)
    assert gi.g_bt[0].tolist()[:5] == [0, 1, 2, 3, 4] and gi.g_bt[1].tolist() == [5] * 8


def test_prefill_buckets_grow_to_2048_tokens_only_where_launches_dominate(monkeypatch):
    """Up to 256 tokens for every model; up to 2,048 where a 2,048-token forward is under 4e12
    FLOP: 2 x 596,049,920 x 2,048 = 2.44e12 for the 0.6B shape, 7.05e12 for 1.7B."""
    from kipp_core.registry import lookup
    from kipp_cuda.graph_sizes import prefill_buckets

    monkeypatch.delenv("KIPP_CUDA_PREFILL_GRAPH_MAX", raising=False)
    small = [16, 32, 64, 128, 256]
    p06, p17 = (lookup(n).config.num_params() for n in ("qwen3-0.6b", "qwen3-1.7b"))
    assert p06 == 596_049_920
    assert prefill_buckets(p06, 40960) == small + [512, 1024, 2048]
    assert prefill_buckets(p17, 40960) == small
    assert prefill_buckets(p17 / 2, 40960) == small + [512, 1024, 2048]  # a TP=2 rank
    assert prefill_buckets(p06, 1000) == small + [512]  # never past the model length
    monkeypatch.setenv("KIPP_CUDA_PREFILL_GRAPH_MAX", "128")
    assert prefill_buckets(p06, 40960) == [16, 32, 64, 128]
    monkeypatch.setenv("KIPP_CUDA_PREFILL_GRAPH_MAX", "1024")
    assert prefill_buckets(p17, 40960) == small + [512, 1024]
    monkeypatch.setenv("KIPP_CUDA_PREFILL_GRAPH_MAX", "lots")
    with pytest.raises(ValueError, match="KIPP_CUDA_PREFILL_GRAPH_MAX"):
        prefill_buckets(p06, 40960)


def test_large_prefill_buckets_stage_apart_and_equal_eager(staged, llm_factory):
    """A prompt of 300 or 600 tokens runs as one replay of the 512- or 1,024-token graph (the
    tiny model is launch-bound), staged in the large buckets' own buffer, so that a decode
    step's upload does not grow; its logits and greedy tokens equal the eager runner's."""
    llm = staged(large_buckets=True)
    runner = llm.engine.backend.runner
    assert runner.prefill_tokens[-3:] == [512, 1024, 2048]
    assert runner.large_inputs is not None and runner.inputs.h_in_np.shape[1] == 256
    keys, replay = [], runner._replay
    runner._replay = lambda key, *a: keys.append(key) or replay(key, *a)
    eager = llm_factory("cuda", dtype="float32", block_size=8, enforce_eager=True)
    cfg = llm.config
    for n in (300, 600):
        ids = [(7 * j) % 5000 + 3 for j in range(n)]
        got, want = llm.logits(ids), eager.logits(ids)
        # Two float32 paths (the padded 512/1,024-row graph and the eager 300/600 rows) whose
        # matmuls block their sums differently: bounded by the longest reduction (the widest
        # matmul plus the n positions attention sums) and the logits' size, not by one
        # machine's 1e-5 (an AVX-512 BLAS made it 1.03e-5 at n = 600).
        terms = max(cfg.intermediate_size, cfg.hidden_size) + n
        assert np.abs(got - want).max() <= f32_paths_atol(np.abs(want).max(), terms)
        out = llm.generate([ids], GREEDY)[0].token_ids
        assert out == eager.generate([ids], GREEDY)[0].token_ids
    assert ("prefill", 512) in keys and ("prefill", 1024) in keys


@pytest.mark.parametrize("second", ["prefill", "decode"])
def test_a_prompt_end_hit_beside_a_graph_replay(staged, llm_factory, second):
    """A prompt-end hit (the head graph) and a prefill or decode graph in one step: the hit's
    logits are read after the other graph's replay, which on a GPU may overwrite them through the
    shared pool if that graph was captured before the head (the stand-ins poison them then). The
    tokens equal the eager engine's. (The GPU found it: the conformance gate batched-equals-
    isolated, a 24-token prompt's hit beside a 7-token prefill.)"""
    params = P(temperature=0, max_tokens=4, ignore_eos=True)
    hit, other = _prompts(4)[3], _prompts(3)[1]  # 21 and 11 tokens
    eager = llm_factory("cuda", dtype="float32", block_size=8)
    want = [o.token_ids for o in eager.generate([hit, other], params)]
    llm = staged()
    assert llm.generate([hit], params)[0].token_ids == want[0]  # cached, with its end hidden
    eng = llm.engine
    if second == "decode":
        eng.add_request("other", other, params)
        eng.step()  # its prefill: it decodes from the next step on
    runner, heads = eng.backend.runner, []
    replay = runner.graphs["head", 1].replay
    runner.graphs["head", 1].replay = lambda: heads.append(1) or replay()
    eng.add_request("hit", hit, params)
    if second == "prefill":
        eng.add_request("other", other, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert heads == [1], "the hit did not take the head graph"
    assert done == {"hit": want[0], "other": want[1]}
