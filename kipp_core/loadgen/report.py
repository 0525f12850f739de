"""A `kipp bench serve` result as markdown: the run's context, then a throughput row and latency
rows (mean / p50 / p90 / p99, ms) for each run."""

from __future__ import annotations

from kipp_core.loadgen.metrics import METRICS

BUSY_WARNING = 0.7  # a client process's CPU time over the run: above it, it may lag the stream
_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "end-to-end"}


def load_label(run: dict) -> str:
    rate, cap = run.get("request_rate"), run.get("concurrency")
    parts = []
    if rate is not None:
        parts.append(f"{rate:g} req/s")
    if cap is not None:
        parts.append(f"concurrency {cap}")
    return ", ".join(parts) or "all at once"


def _f(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _lens(lo_hi) -> str:
    lo, hi = lo_hi
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def to_markdown(result: dict) -> str:
    w = result["workload"]
    sampling = "greedy" if w["temperature"] == 0 else f"temperature {w['temperature']:g}"
    lines = [
        f"### kipp bench serve: {result['url']} ({result['model'] or 'no model field'})",
        "",
        f"- command: `{result['command']}`",
        f"- date: {result['date']}; kipp {result['version']}; client: "
        f"{result['client']['procs']} process(es) on {result['client']['cpu']} "
        f"({result['client']['cpu_count']} cores)",
        f"- workload: {w['num_requests']} requests to {result['endpoint']}, prompts "
        f"{_lens(w['prompt_len'])} tokens ({w['prompt_format']}), outputs "
        f"{_lens(w['output_len'])} tokens, {sampling}"
        f"{', ignore_eos' if w['ignore_eos'] else ''}, seed {w['seed']}, "
        f"{w['warmup_requests']} warm-up requests",
        "",
        "| load | done | errors | seconds | req/s | output tok/s | total tok/s | peak streams |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in result["runs"]:
        lines.append(
            f"| {load_label(run)} | {run['completed']} | {run['errors']} | "
            f"{_f(run['duration_s'], 2)} | {_f(run['request_throughput'], 2)} | "
            f"{_f(run['output_throughput'])} | {_f(run['total_token_throughput'])} | "
            f"{run['peak_concurrency']} |"
        )
    lines += [
        "",
        "| load | ms | mean | p50 | p90 | p99 |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for run in result["runs"]:
        for m in METRICS:
            vals = [run[f"{s}_{m}_ms"] for s in ("mean", "median", "p90", "p99")]
            lines.append(
                f"| {load_label(run)} | {_LABELS[m]} | " + " | ".join(_f(v, 2) for v in vals) + " |"
            )
    notes = []
    for run in result["runs"]:
        for e in run["error_kinds"]:
            notes.append(
                f"- {load_label(run)}: {e['count']} x status {e['status']}: {e['message']}"
            )
        if run["length_mismatches"]:
            notes.append(
                f"- {load_label(run)}: {run['length_mismatches']} completed requests did not "
                "produce their requested number of tokens"
            )
        if run["client_busy"] > BUSY_WARNING:
            notes.append(
                f"- {load_label(run)}: a client process was busy {run['client_busy']:.0%} of "
                "the run, so its timings include its own delays: raise --client-procs"
            )
        if run["tokens_from"] != "usage":
            notes.append(
                f"- {load_label(run)}: token counts from the streamed events "
                f"({run['tokens_from']}): the server sent no usage chunk for some requests"
            )
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"
