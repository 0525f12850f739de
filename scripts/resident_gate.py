"""The conformance gate "batched equals isolated" (tests/conformance/test_backend_gates.py) on the
GPU with resident decode inputs on and off, and the decode attention's empty splits leaving early
(SKIP_EMPTY_SPLITS) on and off: six prompts generated one at a time, then again with staggered
arrivals in one engine, against the eager model. It failed once with both on in the eighteenth
session (BENCHMARKS.md); this says which of the two it follows.

python scripts/resident_gate.py
"""

from __future__ import annotations

import os
import time

import kipp_cuda.kernels.decode_attention as dec
from kipp_core.llm import LLM
from kipp_core.tiny import tiny_path
from tests.conformance.test_backend_gates import GREEDY, prompts, staggered

KW = dict(backend="cuda", dtype="float32", block_size=8, max_num_batched_tokens=40)


def run(tag: str) -> None:
    llm = LLM(str(tiny_path()), kv_cache_memory="1GiB", **KW)
    ps = prompts(6, seed=5)
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in ps]
    done = {i: out.token_ids for i, out in staggered(llm, ps, GREEDY).items()}
    eager = LLM(str(tiny_path()), kv_cache_memory="1GiB", enforce_eager=True, **KW)
    want = [eager.generate([p], GREEDY)[0].token_ids for p in ps]
    print(
        f"{tag}: batched != alone {[i for i in range(6) if done[i] != alone[i]]}, alone != eager "
        f"{[i for i in range(6) if alone[i] != want[i]]}, batched != eager "
        f"{[i for i in range(6) if done[i] != want[i]]}",
        flush=True,
    )


def main() -> None:
    t0 = time.time()
    for resident, skip in (("1", True), ("0", True), ("1", False), ("0", False)):
        os.environ["KIPP_CUDA_RESIDENT_DECODE"] = resident
        dec.SKIP_EMPTY_SPLITS = skip
        run(f"resident {resident}, empty splits leave {skip} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
