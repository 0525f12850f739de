"""The serving benchmark: the shared throughput workload (kipp_core.workload) sent once per
request rate, after untimed warm-up requests, each run summarized."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kipp_core.loadgen.metrics import summarize
from kipp_core.loadgen.report import load_label
from kipp_core.loadgen.runner import run_load
from kipp_core.loadgen.spec import LoadSpec
from kipp_core.workload import random_workload, workload_digest


def run_workload(
    spec: LoadSpec,
    rates: list[float | None],
    num_requests: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    seed: int = 0,
    vocab: int | None = None,
    warmup_requests: int = 0,
    decode: Callable[[list[int]], str] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict]:
    """One run per rate (None: no arrival process, `spec.concurrency` alone sets the pace);
    run k draws its workload from seed + k, so that no run reuses another's prompts. `decode`
    turns the prompt ids into text for text prompts. Returns each run's summary."""
    kw = {} if vocab is None else {"vocab": vocab}

    def prompts(items):
        return [w.prompt_token_ids if decode is None else decode(w.prompt_token_ids) for w in items]

    warm = random_workload(warmup_requests, prompt_lens, output_lens, seed, warmup=True, **kw)
    warm_pairs = list(zip(prompts(warm), [w.max_tokens for w in warm]))
    runs = []
    for k, rate in enumerate(rates):
        items = random_workload(num_requests, prompt_lens, output_lens, seed + k, **kw)
        run = {"request_rate": rate, "concurrency": spec.concurrency}
        run_spec = replace(spec, request_rate=rate, arrival_seed=seed + k, desc=load_label(run))
        max_tokens = [w.max_tokens for w in items]
        result = run_load(run_spec, prompts(items), max_tokens, warm_pairs if k == 0 else ())
        run.update(seed=seed + k, workload_digest=workload_digest(items))
        run.update(summarize(result, [len(w.prompt_token_ids) for w in items], max_tokens))
        runs.append(run)
        if log is not None:
            log(
                f"{load_label(run)}: {run['completed']}/{run['num_requests']} done, "
                f"{run['output_throughput'] or 0:.1f} output tok/s, {run['errors']} errors"
            )
    return runs
