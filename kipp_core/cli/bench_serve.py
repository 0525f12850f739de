"""`kipp bench serve`: a streaming load against any OpenAI-compatible server (kipp serve,
vllm serve, llama-server), measuring throughput, TTFT, TPOT and inter-token latency."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import sys
import urllib.error
import urllib.request
from pathlib import Path

from kipp_core.cli.common import Parser, UsageError
from kipp_core.workload import MAX_ORDINARY_ID

PROG = "kipp bench serve"

EPILOG = """examples:
  kipp bench serve --url http://127.0.0.1:8000 --num-requests 256 --concurrency 256
  kipp bench serve --url http://127.0.0.1:8000 --sweep-rates 10,20,40 --json sweep.json
  kipp bench serve --url http://127.0.0.1:8080 --endpoint chat --prompt-len 512 --output-len 128

The workload (prompts of random token ids, lengths uniform in [--min-len, --max-len] for prompt
and output) is the one `kipp bench --num-requests N --min-len A --max-len B --seed S` runs
offline. Run k of a sweep uses seed S + k, so that no run meets another's prompts in the prefix
cache; a second run against the same server needs another --seed for the same reason.
TTFT: from sending a request to its first streamed token. ITL: each gap between streamed chunks
that carry tokens. TPOT: (end-to-end - TTFT) / (output tokens - 1). Token counts come from the
usage chunk (stream_options.include_usage), else from the chunks.
"""


def _error(msg: str) -> UsageError:
    return UsageError(f"{PROG}: error: {msg}")


def _lens(s: str) -> tuple[int, int]:
    try:
        lo, _, hi = s.partition(":")
        out = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEN or MIN:MAX, got {s!r}") from None
    if not 1 <= out[0] <= out[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {s!r}")
    return out


def _rates(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates, got {s!r}") from None
    if not out or not all(0 < r < math.inf for r in out):
        raise argparse.ArgumentTypeError(f"expected positive finite rates, got {s!r}")
    return out


def build_parser() -> Parser:
    p = Parser(
        prog=PROG,
        description="Measure an OpenAI-compatible server under a streaming load.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    t.add_argument(
        "--endpoint", choices=["completions", "chat"], default="completions", help="which API"
    )
    t.add_argument("--model", default=None, help="the model field (default: /v1/models' first)")
    t.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=256, help="requests a run (default 256)")
    w.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    w.add_argument("--max-len", type=int, default=1024, help="longest prompt and output")
    w.add_argument("--prompt-len", type=_lens, default=None, help="LEN or MIN:MAX (overrides)")
    w.add_argument("--output-len", type=_lens, default=None, help="LEN or MIN:MAX (overrides)")
    w.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default=None,
        help="token ids (default for completions) or their text (chat needs text)",
    )
    w.add_argument("--tokenizer", default="kipp-tiny", help="decodes text prompts (Qwen3's)")
    w.add_argument("--vocab", type=int, default=MAX_ORDINARY_ID, help="prompt ids in [0, VOCAB)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    w.add_argument("--no-ignore-eos", action="store_true", help="for servers that reject it")
    w.add_argument(
        "--warmup-requests", type=int, default=16, help="untimed first (<= 16 tokens out)"
    )
    lo = p.add_argument_group("load")
    lo.add_argument("--concurrency", type=int, default=None, help="requests in flight at most")
    lo.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals a second")
    lo.add_argument("--sweep-rates", type=_rates, default=None, help="one Poisson run per rate")
    lo.add_argument("--client-procs", type=int, default=1, help="client processes (default 1)")
    lo.add_argument("--request-timeout", type=float, default=3600.0, help="seconds a request")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="OUT", default=None, help="write the results as JSON")
    o.add_argument("--markdown", metavar="OUT", default=None, help="write the markdown tables")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _validate(args) -> None:
    if not args.url.startswith(("http://", "https://")):
        raise _error(f"--url must start with http:// or https://, got {args.url!r}")
    for name in ("num_requests", "client_procs"):
        if getattr(args, name) < 1:
            raise _error(f"--{name.replace('_', '-')} must be >= 1")
    if args.min_len < 1 or args.min_len > args.max_len:
        raise _error("need 1 <= --min-len <= --max-len")
    if args.warmup_requests < 0 or args.seed < 0:
        raise _error("--warmup-requests and --seed must be non-negative")
    if not 1 <= args.vocab <= MAX_ORDINARY_ID:
        raise _error(f"--vocab must be in [1, {MAX_ORDINARY_ID}]")
    if args.concurrency is not None and args.concurrency < args.client_procs:
        raise _error("--concurrency must be >= 1 and at least --client-procs")
    if args.client_procs > args.num_requests:
        raise _error("--client-procs must not exceed --num-requests")
    if args.request_rate is not None and not 0 < args.request_rate < math.inf:
        raise _error("--request-rate must be a positive finite number")
    if args.request_rate is not None and args.sweep_rates:
        raise _error("pass --request-rate or --sweep-rates, not both")
    if not 0 <= args.temperature <= 2 or args.request_timeout <= 0:
        raise _error("need 0 <= --temperature <= 2 and --request-timeout > 0")
    for out in (args.json, args.markdown):
        if out and not Path(out).resolve().parent.is_dir():
            raise _error(f"cannot write {out}: no such directory")
    if args.prompt_format is None:
        args.prompt_format = "text" if args.endpoint == "chat" else "ids"
    if args.endpoint == "chat" and args.prompt_format == "ids":
        raise _error("--endpoint chat takes text prompts (--prompt-format text)")


def fetch_models(url: str, api_key: str | None) -> dict:
    """The server's /v1/models answer; ValueError when it cannot be read."""
    req = urllib.request.Request(url.rstrip("/") + "/v1/models")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ValueError(f"cannot read {req.full_url}: {e}") from None


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    _validate(args)
    try:
        return _bench(args, argv)
    except ValueError as e:  # an unreachable server, a failed client process: one line
        raise _error(str(e)) from None


def _bench(args, argv: list[str]) -> int:
    from kipp_core import __version__
    from kipp_core.bench import host
    from kipp_core.loadgen import LoadSpec, run_workload

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    models = fetch_models(args.url, args.api_key)
    model = args.model
    if model is None:
        data = models.get("data") if isinstance(models, dict) else None
        model = data[0].get("id") if data and isinstance(data[0], dict) else None
    lens = (args.min_len, args.max_len)
    decode = None
    if args.prompt_format == "text":
        from kipp_core.resolve import resolve_model
        from kipp_core.tokenizer import Tokenizer

        decode = Tokenizer(resolve_model(args.tokenizer)[0]).decode
    spec = LoadSpec(
        url=args.url,
        model=model,
        endpoint=args.endpoint,
        concurrency=args.concurrency,
        temperature=args.temperature,
        ignore_eos=not args.no_ignore_eos,
        client_procs=args.client_procs,
        request_timeout=args.request_timeout,
        api_key=args.api_key,
        progress=not args.no_progress,
    )
    rates = args.sweep_rates or [args.request_rate]
    runs = run_workload(
        spec,
        rates,
        args.num_requests,
        args.prompt_len or lens,
        args.output_len or lens,
        seed=args.seed,
        vocab=args.vocab,
        warmup_requests=args.warmup_requests,
        decode=decode,
        log=lambda msg: print(f"kipp bench serve: {msg}", file=sys.stderr),
    )
    result = {
        "command": shlex.join(["kipp", "bench", "serve", *argv]),
        "date": date,
        "version": __version__,
        "url": args.url,
        "endpoint": spec.target,
        "model": model,
        "models": models,
        "client": {"procs": args.client_procs, **host()},
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": list(args.prompt_len or lens),
            "output_len": list(args.output_len or lens),
            "prompt_format": args.prompt_format,
            "vocab": args.vocab,
            "seed": args.seed,
            "temperature": args.temperature,
            "ignore_eos": not args.no_ignore_eos,
            "warmup_requests": args.warmup_requests,
        },
        "runs": runs,
    }
    from kipp_core.loadgen.report import to_markdown

    md = to_markdown(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(md)
    sys.stdout.write(md)
    return 0
