"""The engine's own share of a prefix-cache hit's TTFT, with no model at all: the backend is
swapped for one that returns a token and does nothing else, so what is left is validation,
the prefix match, scheduling and output handling. Runs anywhere (CPU).

python tools/profile/engine_overhead.py --prompt-len 6890 --block-size 32
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import numpy as np

from kipp_core.backend import SeqOutput
from kipp_core.llm import LLM
from kipp_core.prompt_end import NUM_HIDDEN_SLOTS
from kipp_core.sampling_params import SamplingParams
from kipp_core.tiny import TINY, write_checkpoint


class NoOpBackend:
    """The backend contract with no model: every sequence of a step gets token 5, after
    `step_s` seconds from the step's start (a device's time, the host idle meanwhile)."""

    def __init__(self, inner, step_s: float = 0.0):
        self.config = inner.config
        self.block_size = inner.block_size
        self.num_blocks = inner.num_blocks
        self.num_hidden_slots = NUM_HIDDEN_SLOTS  # prompt-end hidden states
        self.step_s = step_s

    def execute(self, batch) -> list[SeqOutput]:
        if self.step_s:
            time.sleep(self.step_s)
        return [SeqOutput(token_ids=[5]) for _ in batch.seqs]


def noop_engine_child(model, llm_kwargs, cmd_conn, msg_conn, log_level, step_s=0.0) -> None:
    """kipp_core.server.engine_process._child with NoOpBackend(step_s) in place of the model (a
    process target: api_overhead.py)."""
    import kipp_core.llm

    real = kipp_core.llm.LLM

    class NoOpLLM(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.engine.backend = NoOpBackend(self.engine.backend, step_s)

    kipp_core.llm.LLM = NoOpLLM
    from kipp_core.server import engine_process

    engine_process._child(model, llm_kwargs, cmd_conn, msg_conn, log_level)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt-len", type=int, default=6890)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--runs", type=int, default=20)
    args = p.parse_args()
    cfg = dataclasses.replace(TINY.config, max_position_embeddings=2 * args.prompt_len)
    path = write_checkpoint(tempfile.mkdtemp(), cfg, seed=0, dtype="float32")
    llm = LLM(
        str(path), backend="oracle", max_model_len=2 * args.prompt_len, block_size=args.block_size
    )
    llm.engine.backend = NoOpBackend(llm.engine.backend)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, args.prompt_len).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # fills the prefix cache
    walls, ttfts = [], []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        walls.append(time.perf_counter() - t0)
        ttfts.append(out.metrics.ttft)
    print(
        f"prefix hit of {args.prompt_len} tokens ({out.metrics.num_cached_tokens} cached), "
        f"median of {args.runs}: engine TTFT {statistics.median(ttfts) * 1e3:.3f} ms, "
        f"generate() wall {statistics.median(walls) * 1e3:.3f} ms"
    )


if __name__ == "__main__":
    main()
