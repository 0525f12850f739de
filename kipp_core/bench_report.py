"""`kipp bench`'s result dict as markdown: command, hardware and date, then one table a part."""

from __future__ import annotations


def _f(x, scale=1.0, digits=1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def to_markdown(result: dict) -> str:
    """The result as a markdown section: command, hardware, date, then one table per part."""
    hw, run = result["hardware"], result["run"]
    fb = result.get("fallbacks") or []
    lines = [
        f"### {run['model']} on {run['backend']} ({run['dtype'] or 'default dtype'}, "
        f"{run['quant'] or 'no quant'}){' - FALLBACK RUN' if fb else ''}",
        "",
        *([f"- fallback run: kernels ran their reference paths ({'; '.join(fb)})"] if fb else []),
        f"- command: `{run['command']}`",
        f"- hardware: {hw['gpu'] or 'no GPU'}; {hw['cpu']} ({hw['cpu_count']} cores); "
        f"{hw['platform']}",
        f"- date: {run['date']}; kipp {run['version']}",
        *([f"- {result['rope']}"] if "rope" in result else []),
        f"- peak memory ({result['memory']['kind']}): "
        f"{result['memory']['peak_memory_bytes'] / 2**30:.2f} GiB",
        "",
        "| engine | batch | prompt | gen | prefill tok/s | decode tok/s | TTFT ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    engines = [("kipp", result["rows"])]
    engines += [(p["name"], p["rows"]) for p in result.get("peers", []) if "rows" in p]
    for name, rows in engines:
        for r in rows:
            lines.append(
                f"| {name} | {r['batch_size']} | {r.get('prompt_len', run['prompt_len'])} | "
                f"{r.get('gen_len', run['gen_len'])} | {_f(r['prefill_tok_s'])} | "
                f"{_f(r['decode_tok_s'])} | {_f(r['ttft_s'], 1000)} |"
            )
    for p in result.get("peers", []):
        if "skipped" in p:
            lines.append(f"\n{p['name']}: not measured ({p['skipped']})")
    if "throughput" in result:
        t = result["throughput"]
        lines += [
            "",
            f"Offline throughput, {t['num_requests']} requests: "
            f"{t['requests_s']:.2f} req/s, {t['total_tok_s']:.1f} tok/s total, "
            f"{t['output_tok_s']:.1f} output tok/s.",
        ]
    for p in result.get("peers", []):
        if "throughput" in p:
            lines.append(
                f"{p['name']} on the same workload: {p['throughput']['output_tok_s']:.1f} "
                "output tok/s."
            )
    if "prefix_cache" in result:
        c = result["prefix_cache"]
        lines += [
            "",
            f"Prefix cache, {c['prompt_len']}-token prompt: TTFT "
            f"{_f(c['cold_ttft_s'], 1000)} ms cold, {_f(c['warm_ttft_s'], 1000)} ms for the "
            f"same prompt ({c['warm_cached_tokens']} tokens cached, {c['speedup']:.1f}x), "
            f"{_f(c['prefix_ttft_s'], 1000)} ms with a new last token "
            f"({c['prefix_cached_tokens']} cached, {c['prefix_speedup']:.1f}x).",
        ]
    if "chat" in result:
        lines += [
            "",
            "| chat turn | history tokens | cached | computed | TTFT ms | full-prompt TTFT ms |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in result["chat"]:
            lines.append(
                f"| {r['turn']} | {r['history_tokens']} | {r['cached_tokens']} | "
                f"{r['computed_tokens']} | {_f(r['ttft_s'], 1000)} | "
                f"{_f(r['full_prompt_ttft_s'], 1000)} |"
            )
    return "\n".join(lines) + "\n"
