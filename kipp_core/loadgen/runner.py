"""Runs a load: the requests split over `client_procs` spawned processes (so that the clients
never compete for a GIL with an in-process server, and several cores can read the streams),
started together, their records merged in request order."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

import numpy as np

from kipp_core.loadgen.driver import Share, client_process
from kipp_core.loadgen.spec import LoadSpec
from kipp_core.workload import poisson_arrivals

PER_REQUEST = (
    "index",
    "sent",
    "done",
    "ttft",
    "status",
    "prompt_tokens",
    "output_tokens",
    "chunks",
)
START_DELAY_S = 0.05  # from the start message to the first request: every process has it by then


@dataclass
class LoadResult:
    """Every request's record as arrays in request order (driver.pack's fields), and the run's
    duration: from the start to the last request's end."""

    records: dict
    duration: float


def _shares(spec: LoadSpec, prompts, max_tokens, warmup) -> list[Share]:
    n, procs = len(prompts), spec.client_procs
    arrivals = None
    if spec.request_rate is not None:
        arrivals = poisson_arrivals(n, spec.request_rate, spec.arrival_seed).tolist()
    shares = []
    for k in range(procs):
        idx = list(range(k, n, procs))
        cap = None
        if spec.concurrency is not None:
            cap = spec.concurrency // procs + (k < spec.concurrency % procs)
        shares.append(
            Share(
                indices=idx,
                prompts=[prompts[i] for i in idx],
                max_tokens=[max_tokens[i] for i in idx],
                arrivals=None if arrivals is None else [arrivals[i] for i in idx],
                concurrency=cap,
                warmup=list(warmup)[k::procs],
            )
        )
    return shares


def _merge(parts: list[dict]) -> dict:
    """The processes' packed records as one set in request order (the gaps stay unordered)."""
    out = {k: np.concatenate([p[k] for p in parts]) for k in parts[0] if k != "error"}
    errors = [e for p in parts for e in p["error"]]
    order = np.argsort(out["index"], kind="stable")
    for key in PER_REQUEST:
        out[key] = out[key][order]
    out["error"] = [errors[i] for i in order]
    return out


def run_load(spec: LoadSpec, prompts: list, max_tokens: list[int], warmup=()) -> LoadResult:
    """Send every prompt (token ids or text) with its exact output length; `warmup` pairs of
    (prompt, max_tokens) go first, untimed. Raises ValueError when a client process fails."""
    if spec.client_procs < 1 or spec.client_procs > max(1, len(prompts)):
        raise ValueError(f"client_procs must be in [1, {len(prompts)}], got {spec.client_procs}")
    if spec.concurrency is not None and spec.concurrency < spec.client_procs:
        raise ValueError(
            f"concurrency {spec.concurrency} is below client_procs {spec.client_procs}"
        )
    from tqdm import tqdm

    ctx = mp.get_context("spawn")  # no fork of a process that may run server threads
    counter = ctx.Value("q", 0)
    procs, conns = [], []
    for share in _shares(spec, prompts, max_tokens, warmup):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=client_process, args=(child, spec, share, counter), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    try:
        parts = _gather(spec, procs, conns, counter, len(prompts), tqdm)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    merged = _merge(parts)
    return LoadResult(merged, float(np.max(merged["done"], initial=0.0)))


def _recv(conn, proc) -> tuple:
    try:
        msg = conn.recv()
    except EOFError:
        raise ValueError(f"a client process died (exit code {proc.exitcode})") from None
    if msg[0] == "error":
        raise ValueError(f"load client failed: {msg[1]}")
    return msg


def _gather(spec: LoadSpec, procs, conns, counter, total: int, tqdm) -> list[dict]:
    for conn, proc in zip(conns, procs):  # warm-ups done, bodies built: every client is ready
        _recv(conn, proc)
    start = time.time() + START_DELAY_S
    for conn in conns:
        conn.send(start)
    parts: dict[int, dict] = {}
    with tqdm(
        total=total, desc=spec.desc, unit="req", disable=None if spec.progress else True
    ) as bar:
        while len(parts) < len(conns):
            for conn in wait([c for i, c in enumerate(conns) if i not in parts], timeout=0.2):
                i = conns.index(conn)
                parts[i] = _recv(conn, procs[i])[1]
            bar.update(counter.value - bar.n)
    return [parts[i] for i in range(len(conns))]
