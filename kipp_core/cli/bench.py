"""`kipp bench`: engine benchmarks (kipp_core.bench) with peers in the same run, or the custom
kernels one by one (--kernels). Numbers are never recorded after a kernel fell back."""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shlex
import sys
from pathlib import Path

from kipp_core.cli.common import (
    Parser,
    UsageError,
    add_model_args,
    check_model_args,
    load_llm,
    positive_int,
    setup_logging,
)
from kipp_core.gc_heap import freeze_loaded_heap

EPILOG = """examples:
  kipp bench --model kipp-tiny --backend oracle --batch-sizes 1 --prompt-len 64 --gen-len 16
  kipp bench --model qwen3-8b --backend cuda --batch-sizes 1,8,32 --peers transformers \\
      --json bench.json --markdown bench.md
  kipp bench --random-weights qwen3-32b --backend cuda --quant q8_0 --num-requests 256
  kipp bench --model qwen3-4b --backend mlx --peers mlx-lm --prefix-len 4096 --chat-turns 8
  kipp bench --kernels --json kernels.json
  kipp bench --random-weights qwen3-8b --backend cuda --batch-sizes 1 --max-model-len 131072 \\
      --context-lens 2048,32768,131072 --gen-len 64 --max-num-batched-tokens 16384
  kipp bench serve --url http://127.0.0.1:8000 --concurrency 256   (kipp bench serve --help)

Prefill tok/s: B prompts of --prompt-len tokens with one output token each. Decode tok/s: tokens
made after every request of the batch has its first one, over the time since. TTFT: from arrival
to the first token. Every shape runs once untimed first (--no-warmup to skip). --context-lens
rows: batch 1, the prompt as long as the context (one token shorter at max_model_len), decode
over the context's last --gen-len positions.
"""


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {s!r}")
    return v


def build_parser() -> Parser:
    p = Parser(
        prog="kipp bench",
        description="Measure prefill, decode, TTFT and memory; or time each custom kernel.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b = p.add_argument_group("benchmark")
    b.add_argument(
        "--random-weights",
        metavar="SHAPE",
        default=None,
        help="benchmark random weights of a registry shape (cached under KIPP_HOME)",
    )
    b.add_argument("--batch-sizes", type=_ints, default=[1, 8], help="comma list (default 1,8)")
    b.add_argument("--prompt-len", type=_positive, default=512, help="prompt tokens (default 512)")
    b.add_argument("--gen-len", type=_positive, default=128, help="generated tokens (default 128)")
    b.add_argument(
        "--num-requests",
        type=_positive,
        default=0,
        help="offline throughput over N requests with random lengths (0 = skip)",
    )
    b.add_argument("--min-len", type=_positive, default=100, help="throughput: shortest length")
    b.add_argument("--max-len", type=_positive, default=1024, help="throughput: longest length")
    b.add_argument(
        "--prefix-len", type=_positive, default=0, help="prefix-cache cold/warm TTFT (0 = skip)"
    )
    b.add_argument(
        "--chat-turns", type=_positive, default=0, help="multi-turn chat TTFT per turn (0 = skip)"
    )
    b.add_argument(
        "--context-lens",
        type=_ints,
        default=[],
        metavar="N,N",
        help="batch-1 prefill of N tokens and decode at an N-token context, for each N "
        "(long context: with --max-model-len, and YaRN where the model needs it)",
    )
    b.add_argument(
        "--peers",
        default="",
        help="peer engines measured in the same run: transformers, mlx-lm, or auto (the one on "
        "the backend's device); one that is not installed is reported as skipped",
    )
    b.add_argument("--no-warmup", action="store_true", help="time the first run of each shape")
    b.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="prefill runs a shape; the median counts (default 3)",
    )
    b.add_argument(
        "--allow-fallback",
        action="store_true",
        help="record even when kernels fall back to their reference paths (a CPU run of "
        "--backend cuda or mlx), labelled as a fallback run",
    )
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", metavar="OUT", default=None, help="write the results as JSON")
    b.add_argument("--markdown", metavar="OUT", default=None, help="write a markdown table")
    b.add_argument(
        "--kernels",
        action="store_true",
        help="time each custom kernel against its reference and the device's ceilings (GPU)",
    )
    add_model_args(p)
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:  # the load generator against a running server
        from kipp_core.cli.bench_serve import main as serve_main

        return serve_main(argv[1:])
    args = build_parser().parse_args(argv)
    from kipp_core import bench

    command = shlex.join(["kipp", "bench", *argv])
    if args.kernels:
        return _kernels(args, command)
    if args.gen_len < 2:
        raise UsageError("kipp bench: error: --gen-len must be >= 2 (decode needs two tokens)")
    if args.prompt_len < 1 or args.min_len < 1 or args.min_len > args.max_len:
        raise UsageError(
            "kipp bench: error: need --prompt-len >= 1 and 1 <= --min-len <= --max-len"
        )
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    if peers == ["auto"]:  # every peer that can share the backend's device
        peers = ["transformers"] if args.backend != "mlx" else ["mlx-lm"]
    for name in peers:
        if name not in bench.PEERS:
            raise UsageError(
                f"kipp bench: error: unknown peer {name!r} (choose from {', '.join(bench.PEERS)})"
            )
    setup_logging(args.verbose)
    check_model_args(args, "kipp bench")
    if args.random_weights:
        args.model = str(_random_weights(args.random_weights))
    spec = bench.BenchSpec(
        batch_sizes=args.batch_sizes,
        prompt_len=args.prompt_len,
        gen_len=args.gen_len,
        warmup=not args.no_warmup,
        repeats=args.repeats,
        num_requests=args.num_requests,
        min_len=args.min_len,
        max_len=args.max_len,
        prefix_len=args.prefix_len,
        chat_turns=args.chat_turns,
        context_lens=args.context_lens,
        seed=args.seed,
    )
    llm = load_llm(args)
    # A kernel that falls back does so at load or in its first step: refuse before the long run.
    llm.generate([[1, 2, 3]], bench.greedy(2), use_tqdm=False)

    model_path, backend = llm.checkpoint.path, llm.backend_name

    def check():  # another backend loaded in this process (tests) does not count
        return bench.check_no_fallbacks(args.allow_fallback, backend)

    check()

    def log(msg):
        print(f"kipp bench: {msg}", file=sys.stderr)

    freeze_loaded_heap()  # as the engine process of `kipp serve` runs, for a like comparison
    try:
        result = bench.run_benchmarks(llm, spec, log)
        check()
    finally:
        gc.unfreeze()  # the LLM's cycles must be collectable again
    del llm  # free the device for the peers
    gc.collect()
    if backend == "cuda":
        import torch

        torch.cuda.empty_cache()
    device = "cuda" if backend == "cuda" else "cpu"
    result["peers"] = [
        bench.run_peer(n, model_path, spec, args.dtype, device, args.quant) for n in peers
    ]
    result["fallbacks"] = check()
    from kipp_core import __version__

    result["hardware"] = bench.hardware()
    result["run"] = {
        "command": command,
        "model": args.random_weights or args.model,
        "model_path": str(model_path),
        "random_weights": bool(args.random_weights),
        "backend": backend,
        "dtype": args.dtype,
        "quant": args.quant,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "version": __version__,
    }
    from kipp_core.bench_report import to_markdown

    _write(result, to_markdown(result), args)
    return 0


def _write(result: dict, markdown: str, args) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown)
    sys.stdout.write(markdown)


def _random_weights(shape: str) -> Path:
    from tqdm import tqdm

    from kipp_core.tiny import random_checkpoint

    with tqdm(total=1, desc=f"random {shape}", unit="param", unit_scale=True, disable=None) as bar:

        def progress(done, total):
            bar.total = total
            bar.update(done - bar.n)

        return random_checkpoint(shape, progress=progress)


def _kernels(args, command: str) -> int:
    import importlib.util

    from kipp_core.bench import check_no_fallbacks, hardware

    gpu = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        gpu = torch.cuda.is_available()
    if not gpu:
        raise ValueError("--kernels needs a CUDA GPU, and none is visible")
    from kipp_cuda.kernels.bench import run_kernel_bench

    rows = run_kernel_bench()
    check_no_fallbacks()
    result = {"command": command, "hardware": hardware(), "kernels": rows}
    md = [f"- command: `{command}`", f"- hardware: {result['hardware']['gpu']}", ""]
    if rows:
        keys = list(rows[0])
        md += ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
        md += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    _write(result, "\n".join(md) + "\n", args)
    return 0
