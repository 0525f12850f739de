"""The backend contract on mixed steps (prefill chunks, decodes, scores, logits and speculative
verification in one batch) against the oracle backend; options and the KV budget; the benchmark
entry points."""

from __future__ import annotations

import numpy as np
import pytest

from kipp_core.backend import BackendOptions, ModelInput, SeqInput
from kipp_core.checkpoint import Checkpoint
from kipp_core.kv_memory import parse_kv_memory
from kipp_core.llm import LLM
from kipp_core.sampling import SamplerState, SamplingParams
from kipp_mlx.kv_budget import DEFAULT_CAP, num_kv_blocks
from oracle.backend import OracleBackend
from tests.conftest import f32_paths_atol, logprob_atol, small_config
from tests.mlx.conftest import make_backend, random_ids

CFG = small_config(
    vocab_size=512, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False
)


def _state(seed, temperature, prompt, out=()):
    p = SamplingParams(
        temperature=temperature, top_k=50, top_p=0.9, seed=seed, repetition_penalty=1.1
    )
    return SamplerState(p, seed, prompt_token_ids=prompt, output_token_ids=list(out))


MAX_LOGIT = 16.0  # above any logit of these random weights (kipp-tiny's reach ~12)


def _steps():
    a, b, c = random_ids(20, 512, 1), random_ids(20, 512, 2), random_ids(5, 512, 3)
    ta, tb, tc = [4, 9, 1, 10], [0, 2, 5], [8]
    yield [
        SeqInput(
            1,
            a,
            0,
            ta,
            sampler=_state(1, 0.0, a),
            num_logprobs=3,
            score_targets=a[1:],
            num_score_logprobs=2,
        ),
        SeqInput(2, b[:13], 0, tb),
    ]
    yield [
        SeqInput(1, [17], 20, ta, sampler=_state(1, 0.8, a, [17]), num_logprobs=0),
        SeqInput(2, b[13:], 13, tb, sampler=_state(2, 1.0, b), num_logprobs=2),
        SeqInput(3, c, 0, tc, return_logits=True, sampler=_state(3, 0.0, c)),
    ]
    # verification: token 33 plus three drafts, greedy and seeded
    yield [
        SeqInput(
            1,
            [33, 5, 6, 7],
            21,
            ta,
            sampler=_state(1, 0.0, a, [17, 33]),
            draft_token_ids=[5, 6, 7],
            num_logprobs=1,
        ),
        SeqInput(
            2,
            [44, 1, 2],
            20,
            tb,
            sampler=_state(2, 0.9, b, [44]),
            draft_token_ids=[1, 2],
            draft_probs=np.full((2, 512), 1 / 512, np.float32),
        ),
    ]
    # a pure decode step: ragged contexts in one batched attention
    yield [
        SeqInput(1, [50], 25, ta, sampler=_state(1, 0.7, a, [17, 33, 5]), num_logprobs=2),
        SeqInput(2, [51], 23, tb, sampler=_state(2, 0.0, b, [44, 1])),
    ]


def test_mixed_steps_equal_oracle_backend(make_checkpoint):
    path = make_checkpoint(CFG, seed=30)
    ours = make_backend(path, block_size=8, num_blocks=12)
    ref = OracleBackend(Checkpoint(path), BackendOptions(block_size=8, num_blocks=12))
    # MLX's and numpy's float32 sums in their own orders: bounded by the widest matmul plus
    # the longest context (~30 positions here) and the logits' size (f32_paths_atol)
    terms = max(CFG.intermediate_size, CFG.hidden_size) + 32
    for step in _steps():
        got, want = ours.execute(ModelInput(step)), ref.execute(ModelInput(step))
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids
            for name in ("logprobs", "scores"):
                gl, wl = getattr(g, name), getattr(w, name)
                assert (gl is None) == (wl is None)
                for x, y in zip(gl or [], wl or []):
                    assert (x.token_id, x.rank) == (y.token_id, y.rank)
                    tol = logprob_atol(MAX_LOGIT, terms, CFG.vocab_size)
                    assert x.logprob == pytest.approx(y.logprob, abs=tol)
                    assert [t for t, _ in x.top] == [t for t, _ in y.top]
            if w.logits is not None:
                atol = f32_paths_atol(np.abs(w.logits).max(), terms)
                np.testing.assert_allclose(g.logits, w.logits, rtol=0, atol=atol)


def test_speculative_greedy_equals_plain(tiny_path):
    prompt = [5, 6, 7, 8, 9] * 6
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(tiny_path), backend="mlx", dtype="float32").generate([prompt], sp)[0]
    spec = LLM(str(tiny_path), backend="mlx", dtype="float32", speculative="ngram")
    out = spec.generate([prompt], sp)[0]
    assert out.token_ids == plain.token_ids
    assert spec.engine.spec.proposed > 0


def test_steps_from_another_thread(tiny_path):
    """The server loads in one thread and steps the engine in a worker thread; MLX streams are
    bound to threads, so the CPU layout's streams must follow."""
    import threading

    llm = LLM(str(tiny_path), backend="mlx")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    here = llm.generate([[1, 2, 3]], sp)[0].token_ids
    got = {}
    t = threading.Thread(target=lambda: got.update(ids=llm.generate([[1, 2, 3]], sp)[0].token_ids))
    t.start()
    t.join()
    assert got.get("ids") == here


def test_prompt_logprobs_equal_oracle(tiny_path):
    ids = random_ids(30, 151000, 4)
    got = LLM(str(tiny_path), backend="mlx", dtype="float32").score(ids, top_n=3)[0]
    want = LLM(str(tiny_path)).score(ids, top_n=3)[0]
    assert got[0] is None and want[0] is None
    tol = logprob_atol(MAX_LOGIT, 192 + len(ids), 151936)  # kipp-tiny: I = 192, |x| <= ~12
    for x, y in zip(got[1:], want[1:]):
        assert (x.token_id, [t for t, _ in x.top]) == (y.token_id, [t for t, _ in y.top])
        assert x.logprob == pytest.approx(y.logprob, abs=tol)
        # Deep in a 152k vocabulary, neighbours sit within the 1e-6 that separates two
        # float32 implementations, so a rank there may move by one or two.
        assert x.rank == y.rank or (y.rank > 100 and abs(x.rank - y.rank) <= 3)


# -- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(dtype="float64"), "'float64'"),
        (dict(kv_quant="int4"), "'int4'"),
        (dict(tensor_parallel=2), "tensor_parallel 2"),
        (dict(device="tpu"), "'tpu'"),
        (dict(block_size=0), "block_size"),
        (dict(num_blocks=0), "num_blocks"),
        (dict(num_blocks=None, kv_cache_memory="lots"), "'lots'"),
        (dict(num_blocks=None, kv_cache_memory=1.5), "1.5"),
    ],
)
def test_bad_options_raise(tiny_path, kw, match):
    with pytest.raises(ValueError, match=match):
        make_backend(tiny_path, **kw)


def test_kv_budget():
    assert parse_kv_memory("4GiB") == ("bytes", 4 << 30)
    assert parse_kv_memory("512 MiB") == ("bytes", 512 << 20)
    assert parse_kv_memory("1.5GB") == ("bytes", 1.5e9) and parse_kv_memory("123B")[1] == 123
    cfg = small_config()  # 2 layers x 2 kv heads x 32: 512 bytes a token in float32 K and V
    per_block = 32 * 2 * 2 * 2 * 32 * 4
    opts = BackendOptions(block_size=32)
    assert num_kv_blocks(BackendOptions(num_blocks=7), cfg, 4) == 7
    assert num_kv_blocks(BackendOptions(kv_cache_memory="1MiB"), cfg, 4) == (1 << 20) // per_block
    assert num_kv_blocks(opts, cfg, 4) == 4 * 4096 // 32  # 4 contexts, far below the cap
    big = small_config(num_hidden_layers=64, num_key_value_heads=8, head_dim=128)
    n = num_kv_blocks(BackendOptions(max_model_len=4096), big, 2)
    assert n == DEFAULT_CAP // (32 * 2 * 64 * 8 * 128 * 2) and n * 32 >= 4096
    q8 = num_kv_blocks(BackendOptions(kv_cache_memory="1MiB", kv_quant="q8_0"), cfg, 4)
    assert q8 == (1 << 20) // (32 * 2 * 2 * 2 * (32 + 2))


# -- benchmark entry points -------------------------------------------------------------------


def test_bench_entry_points(tiny_path):
    from kipp_mlx.bench import KippRunner, bench_kipp, compare

    r = bench_kipp(str(tiny_path), prompt_len=8, decode_tokens=2, repeats=1, dtype="float32")
    assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and len(r["decode_s"]) == 1
    pytest.importorskip("mlx_lm")
    from kipp_mlx.peer import PeerRunner

    runners = {"kipp": KippRunner(str(tiny_path), 8, 2), "mlx-lm": PeerRunner(str(tiny_path), 8, 2)}
    both = compare(runners, repeats=2)
    assert all(len(v["prefill_s"]) == 2 and v["decode_tok_s"] > 0 for v in both.values())
