"""An engine step of `--seqs` decoding sequences with no model at all (engine_overhead.py's
NoOpBackend): its time (median, p99, max) and the garbage collector's pauses over the run, with
the loaded heap frozen as the engine process freezes it (kipp_core/gc_heap.py) or, with
`--no-freeze`, not (`--final-only`: the requests report only when done, as offline LLM.generate
runs them, so the step's cost beside a stream's shows what streaming adds; `--plain`: every
stream's step a RequestOutput, no TokenDelta tuples); then the step's
EngineMessage pickled as the engine process sends it
(kipp_core/server/wire.py) and as plain dataclasses, and unpickled as the API process reads it.
Runs anywhere (CPU).

python tools/profile/engine_message.py --seqs 256 [--no-freeze] [--final-only | --plain]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import statistics
import time

import numpy as np
from engine_overhead import NoOpBackend  # tools/profile/, beside this file

from kipp_core.gc_heap import freeze_loaded_heap
from kipp_core.llm import LLM
from kipp_core.sampling_params import SamplingParams
from kipp_core.server.engine_worker import EngineMessage
from kipp_core.server.wire import pack, unpack
from kipp_core.tiny import tiny_path


def _ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--no-freeze", action="store_true")
    p.add_argument("--final-only", action="store_true")
    p.add_argument("--plain", action="store_true", help="every output a RequestOutput")
    args = p.parse_args()
    llm = LLM(str(tiny_path()), backend="oracle", kv_cache_memory="4GiB")
    engine = llm.engine
    engine.backend = NoOpBackend(engine.backend)
    rng = np.random.default_rng(0)
    if not args.no_freeze:
        freeze_loaded_heap()
    params = SamplingParams(temperature=0, max_tokens=args.steps + 100, ignore_eos=True)
    for i in range(args.seqs):
        prompt = rng.integers(1000, 50000, 500).tolist()
        kind = {"final_only": True} if args.final_only else {"delta": True}
        engine.add_request(f"r{i}", prompt, params, **kind)
    for _ in range(10):  # past the prefills
        engine.step()
    pauses, began = [], []

    def watch(phase, info):
        if phase == "start":
            began.append(time.perf_counter())
        elif info["generation"] == 2:
            pauses.append(time.perf_counter() - began[-1])

    gc.callbacks.append(watch)
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        msg = EngineMessage()  # as the engine process's worker makes it
        msg.outputs = engine.step(None if args.plain else msg.deltas)
        msg.stats = engine.metrics()
        steps.append(time.perf_counter() - t)
    gc.callbacks.remove(watch)
    dump = pickle.HIGHEST_PROTOCOL
    packed, plain = pickle.dumps(pack(msg), dump), pickle.dumps(msg, dump)
    step_ms = np.array(steps) * 1e3
    rows = {
        "engine step + metrics": statistics.median(steps) * 1e3,
        "  its p99": float(np.percentile(step_ms, 99)),
        "  its max": float(step_ms.max()),
        f"full collections ({len(pauses)}), longest": max(pauses, default=0.0) * 1e3,
        "pack + pickle (sent)": _ms(lambda: pickle.dumps(pack(msg), dump), 200),
        "unpickle + unpack (read)": _ms(lambda: unpack(pickle.loads(packed)), 200),
        "dataclasses, pickle": _ms(lambda: pickle.dumps(msg, dump), 200),
        "dataclasses, unpickle": _ms(lambda: pickle.loads(plain), 200),
    }
    frozen = "not frozen" if args.no_freeze else "the loaded heap frozen"
    print(f"{len(msg.outputs)} outputs and {len(msg.deltas)} token deltas a step, ", end="")
    print(f"{args.steps} steps, {frozen}; ", end="")
    print(f"a message {len(packed)} bytes packed, {len(plain)} plain")
    for name, value in rows.items():
        print(f"{name:34s} {value:7.3f} ms")


if __name__ == "__main__":
    main()
