"""Prompt logprobs on every backend: equal to the oracle's log-softmax across score chunks, and a
4,000-token prompt scored without [T, vocab] logits at once (peak RSS growth under 1 GB)."""

from __future__ import annotations

import numpy as np

from kipp_core.backend import SCORE_CHUNK
from kipp_core.checkpoint import Checkpoint
from oracle.qwen3 import forward, load_weights
from tests.conformance.test_backend_gates import prompts
from tests.conftest import status_mb


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    s = x - x.max(axis=-1, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=-1, keepdims=True))


def test_prompt_logprobs_across_chunks_equal_the_oracle(make_llm, tiny_path):
    n = 2 * SCORE_CHUNK + 37  # three chunks, the last one partial
    p = prompts(1, seed=3, lo=n, hi=n + 1)[0]
    got = make_llm().score(p, top_n=2)[0]
    want = _log_softmax(forward(load_weights(Checkpoint(tiny_path)), p))
    assert got[0] is None and len(got) == n
    # float32 logits within 1e-5 relative of the oracle's (|x| < 10 here) move a logprob by at
    # most twice their largest error, the logit's own and the log-sum-exp's: 2e-4.
    np.testing.assert_allclose(
        [lp.logprob for lp in got[1:]], [want[j, p[j + 1]] for j in range(n - 1)], atol=2e-4
    )
    assert [lp.top[0][0] for lp in got[1:]] == [int(np.argmax(want[j])) for j in range(n - 1)]


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def test_prompt_logprobs_of_a_long_prompt_stay_small(make_llm, backend):
    """[4000, 151936] float32 logits alone would be 2.4 GB; chunks of 256 rows are 155 MB. (MLX's
    CPU build takes ~4 s a chunk, so 2,000 tokens there: 1.2 GB unchunked, still past the bound.)"""
    n = 2000 if backend == "mlx" else 4000
    llm = make_llm()
    p = prompts(1, seed=4, lo=n, hi=n + 1)[0]
    llm.score(p[:64], top_n=1)  # warm: allocator pools, lazily built kernels
    _reset_peak()
    base = status_mb("VmHWM")
    got = llm.score(p, top_n=1)[0]
    assert len(got) == n
    assert status_mb("VmHWM") - base < 1024
