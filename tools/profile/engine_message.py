"""What `kipp serve` adds to each engine step when the engine runs in its own process: a step of
`--seqs` decoding sequences with no model at all (engine_overhead.py's NoOpBackend), then its
EngineMessage pickled as the engine process sends it (kipp_core/server/wire.py) and as plain
dataclasses, and unpickled as the API process reads it. Runs anywhere (CPU).

python tools/profile/engine_message.py --seqs 256
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time

import numpy as np
from engine_overhead import NoOpBackend  # tools/profile/, beside this file

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
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    llm = LLM(str(tiny_path()), backend="oracle", kv_cache_memory="4GiB")
    engine = llm.engine
    engine.backend = NoOpBackend(engine.backend)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", rng.integers(1000, 50000, 200).tolist(), params, delta=True)
    for _ in range(10):  # past the prefills
        engine.step()
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        msg = EngineMessage(engine.step(), stats=engine.metrics())
        steps.append(time.perf_counter() - t)
    dump = pickle.HIGHEST_PROTOCOL
    packed, plain = pickle.dumps(pack(msg), dump), pickle.dumps(msg, dump)
    rows = {
        "engine step + metrics": statistics.median(steps) * 1e3,
        "pack + pickle (sent)": _ms(lambda: pickle.dumps(pack(msg), dump), 200),
        "unpickle + unpack (read)": _ms(lambda: unpack(pickle.loads(packed)), 200),
        "dataclasses, pickle": _ms(lambda: pickle.dumps(msg, dump), 200),
        "dataclasses, unpickle": _ms(lambda: pickle.loads(plain), 200),
    }
    print(f"{len(msg.outputs)} outputs a step; {len(packed)} bytes packed, {len(plain)} plain")
    for name, ms in rows.items():
        print(f"{name:28s} {ms:7.3f} ms")


if __name__ == "__main__":
    main()
