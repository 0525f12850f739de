"""Where an MLX decode step's time goes: host against device, kernel by kernel, Kipp beside mlx-lm.

    python tools/profile/mlx_decode_profile.py --shape qwen3-0.6b [--quant affine4] \
        [--prompt-len 2048] [--decode-tokens 64] [--engines kipp,mlx-lm] [--kernels]
        [--prompt-kernels] [--json F]

For each engine, on a random-weight checkpoint of the registry shape: decode ms a token (median
of three runs after a warm-up); for Kipp also the host's ms a step inside the backend's step
(building the graph and queueing it with mx.async_eval), the rest being the wait for the device.
`--kernels` records one more run under torch.profiler (CUPTI sees every kernel in the process,
MLX's included, CUDA graphs too) and prints each kernel's device time a token, so the device's
busy time a token stands beside the step's wall time; `--prompt-kernels` adds the same table for the
prompt's step (device time the prompt). MLX's knobs are environment variables of
this process (MLX_MAX_OPS_PER_BUFFER, MLX_USE_CUDA_GRAPHS); KIPP_MLX_COMPILE=0 runs Kipp's eager
step. One JSON line an engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def kipp_runner(path, args):
    from kipp_mlx.bench import KippRunner

    r = KippRunner(str(path), args.prompt_len, args.decode_tokens, quant=args.quant)
    be = r.llm.engine.backend
    host = []
    run = be._run

    def timed(seqs):
        t = time.perf_counter()
        out = run(seqs)
        host.append((len(seqs[0].token_ids), time.perf_counter() - t))
        return out

    be._run = timed
    return r, host


def peer_runner(path, args):
    from kipp_mlx.peer import PeerRunner

    return PeerRunner(str(path), args.prompt_len, args.decode_tokens, quant=args.quant), None


def kipp_decode(r, prof, prompt: bool = False) -> None:
    """KippRunner.run profiled over the decode steps (`prompt`: over the prompt's step alone)."""
    eng = r.llm.engine
    if prompt:
        prof.start()
    eng.add_request("profiled", r.prompt, r.params)
    while not any(o.outputs[0].token_ids for o in eng.step()):
        pass
    (prof.stop if prompt else prof.start)()
    while eng.has_unfinished_requests():
        eng.step()


def peer_decode(r, prof, prompt: bool = False) -> None:
    from mlx_lm.generate import generate_step

    if prompt:
        prof.start()
    gen = generate_step(r.prompt, r.model, max_tokens=r.decode_tokens + 1)
    next(gen)
    (prof.stop if prompt else prof.start)()
    for _ in gen:
        pass


def kernel_table(decode, r, tokens: int, top: int, prompt: bool = False) -> dict:
    """Each kernel's device time a decode token, the prompt's kernels left out (`prompt`: the
    prompt's kernels alone, `tokens` 1: their time for the whole prompt)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    prof = profile(activities=[ProfilerActivity.CUDA])
    decode(r, prof, prompt)
    if not prompt:
        prof.stop()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / tokens, e.count / tokens, e.key))
    rows.sort(reverse=True)
    return {
        "device_us_per_token": sum(r[0] for r in rows),
        "kernels_per_token": sum(r[1] for r in rows),
        "top": [{"us": round(t, 2), "n": round(n, 2), "name": k[:90]} for t, n, k in rows[:top]],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--quant", default=None)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--engines", default="kipp,mlx-lm")
    p.add_argument("--kernels", action="store_true")
    p.add_argument(
        "--prompt-kernels", action="store_true", help="also the prompt step's kernels (us a prompt)"
    )
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from kipp_core.tiny import random_checkpoint

    path = random_checkpoint(args.shape)
    knobs = {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "KIPP_MLX"))}
    for engine in args.engines.split(","):
        make = kipp_runner if engine == "kipp" else peer_runner
        r, host = make(path, args)
        r.run()
        if host is not None:
            host.clear()
        runs = [r.run() for _ in range(3)]
        rec = {
            "engine": engine,
            "shape": args.shape,
            "quant": args.quant,
            "prompt_len": args.prompt_len,
            "knobs": knobs,
            "decode_ms_per_token": 1e3 * statistics.median(d for _, d in runs) / r.decode_tokens,
            "prefill_ms": 1e3 * statistics.median(p for p, _ in runs),
        }
        if host:
            dec = [t for n, t in host if n == 1]
            rec["host_ms_per_decode_step"] = 1e3 * statistics.median(dec)
        if args.kernels:
            try:
                decode = kipp_decode if engine == "kipp" else peer_decode
                rec["kernels"] = kernel_table(decode, r, r.decode_tokens, args.top)
                if args.prompt_kernels:
                    rec["prompt_kernels"] = kernel_table(decode, r, 1, args.top, prompt=True)
            except Exception as e:  # a profiler that cannot attach leaves the timings standing
                rec["kernels"] = f"{type(e).__name__}: {e}"
        line = json.dumps(rec)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(line + "\n")
        del r
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
