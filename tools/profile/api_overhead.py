"""The API process's own cost per streamed token: `kipp serve`'s server (this process) over an
engine process whose backend does nothing (engine_overhead.py's NoOpBackend), loaded by `kipp
bench serve` in another process. Prints the output tok/s the server delivered and this process's
CPU time per delivered token (its event loop and pipe threads); `--profile` adds a cProfile of
the event loop's thread. Runs anywhere (CPU); on a small host the client competes for the cores.

python tools/profile/api_overhead.py --num-requests 256 --concurrency 256 --output-len 256
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from kipp_core.frontend import Frontend
from kipp_core.gc_heap import freeze_loaded_heap
from kipp_core.server.context import ServerConfig
from kipp_core.server.engine_process import EngineProcess
from kipp_core.server.server import APIServer, ServerThread
from kipp_core.tiny import tiny_path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/profile/
from engine_overhead import noop_engine_child  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--output-len", default="256")
    p.add_argument("--prompt-len", default="100")
    p.add_argument("--step-ms", type=float, default=0.0, help="a step's device time to stand in")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    model = str(tiny_path())

    def launch():
        kw = {"backend": "oracle", "kv_cache_memory": "4GiB", "max_num_seqs": args.concurrency}
        child = functools.partial(noop_engine_child, step_s=args.step_ms / 1e3)
        return Frontend(model), EngineProcess(model, kw, child)

    server = ServerThread(
        APIServer(ServerConfig(port=0, access_log=False), engine_process=launch)
    ).start()
    deadline = time.monotonic() + 120
    while True:  # the engine process loads in the background
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            assert time.monotonic() < deadline, "the server did not load"
            time.sleep(0.2)
    freeze_loaded_heap()  # as `kipp serve` does once loaded
    prof = cProfile.Profile() if args.profile else None
    try:
        if prof is not None:  # the event loop's thread
            server.loop.call_soon_threadsafe(prof.enable)
        cpu0, t0 = time.process_time(), time.perf_counter()
        out = os.path.join(tempfile.mkdtemp(), "serve.json")
        cmd = [sys.executable, "-m", "kipp_core.cli.main", "bench", "serve", "--url", server.url]
        cmd += ["--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency)]
        cmd += ["--prompt-len", args.prompt_len, "--output-len", args.output_len]
        cmd += ["--vocab", "1000", "--json", out, "--no-progress"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        if prof is not None:
            done = threading.Event()
            server.loop.call_soon_threadsafe(lambda: (prof.disable(), done.set()))
            done.wait(10)
    finally:
        server.stop()
    with open(out) as f:
        report = json.load(f)
    run = report["runs"][0]
    tokens = run["total_output_tokens"]
    print(
        f"{tokens} tokens in {wall:.1f} s: {run['output_throughput']:.0f} output tok/s, "
        f"inter-token p99 {run['p99_itl_ms']:.1f} ms "
        f"delivered; API process CPU {cpu:.1f} s = {cpu / tokens * 1e6:.1f} us a token"
    )
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
