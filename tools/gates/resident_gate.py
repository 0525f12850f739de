"""The conformance gate "batched equals isolated" (tests/conformance/test_backend_gates.py) on the
GPU with resident decode inputs on and off, and the decode attention's empty splits leaving early
(SKIP_EMPTY_SPLITS) on and off: six prompts generated one at a time, then again with staggered
arrivals in one engine, each against the eager model (graphs off, both settings off), with the
prefix cache on (the staggered run's prompts are then prompt-end hits of the alone run's) and off;
and whether the fused merge's arrival counters are all back at zero after a run (a miscount
leaves one off, which then corrupts every later merge). A failure that follows the prefix cache and
not either setting is a prompt-end hit's, as the head graph's memory-pool bug was
(benchmarks/LOG.md, entry c5b41aa).

python tools/gates/resident_gate.py [--budget SECONDS] [--reps N]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import kipp_cuda.kernels.decode_attention as dec
from kipp_core.llm import LLM
from kipp_core.tiny import tiny_path
from kipp_cuda.kernels import split_merge
from tests.conformance.test_backend_gates import GREEDY, prompts, staggered

KW = dict(backend="cuda", dtype="float32", block_size=8, max_num_batched_tokens=40)


def dirty_counters() -> int:
    """Arrival counters not at zero (every merge re-arms its own)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return sum(int((c != 0).sum()) for held in split_merge._COUNTERS.values() for c in held)


def run(tag: str, ps, want, prefix: bool) -> None:
    llm = LLM(str(tiny_path()), kv_cache_memory="1GiB", enable_prefix_caching=prefix, **KW)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in ps]
    d_alone = dirty_counters()
    done = {i: out.token_ids for i, out in staggered(llm, ps, GREEDY).items()}
    bad = [i for i in range(len(ps)) if not (done[i] == alone[i] == want[i])]
    print(
        f"{tag}: batched != alone {[i for i in bad if done[i] != alone[i]]}, alone != eager "
        f"{[i for i in bad if alone[i] != want[i]]}, batched != eager "
        f"{[i for i in bad if done[i] != want[i]]}; counters off zero after alone {d_alone}, "
        f"after batched {dirty_counters()}",
        flush=True,
    )
    for i in bad:
        print(f"    {i}: eager {want[i][:5]} alone {alone[i][:5]} batched {done[i][:5]}")
    del llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=180.0, help="start no run after this (s)")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    t0 = time.time()
    ps = prompts(6, seed=5)
    os.environ["KIPP_CUDA_RESIDENT_DECODE"] = "0"
    dec.SKIP_EMPTY_SPLITS = False
    eager = LLM(str(tiny_path()), kv_cache_memory="1GiB", enforce_eager=True, **KW)
    want = [eager.generate([p], GREEDY)[0].token_ids for p in ps]
    del eager
    plan = [(r, s, True) for _ in range(args.reps) for r, s in (("1", 1), ("0", 1), ("1", 0))]
    plan += [("0", 0, True), ("1", 1, False), ("0", 1, False)]
    for resident, skip, prefix in plan:
        if time.time() - t0 > args.budget:
            print(f"budget spent; not run: resident {resident}, skip {skip}, prefix {prefix}")
            continue
        os.environ["KIPP_CUDA_RESIDENT_DECODE"] = resident
        dec.SKIP_EMPTY_SPLITS = bool(skip)
        tag = f"resident {resident}, empty splits leave {skip}, prefix cache {int(prefix)}"
        run(f"{tag} ({time.time() - t0:.0f} s)", ps, want, prefix)


if __name__ == "__main__":
    main()
