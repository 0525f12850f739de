"""Runs a load: the requests split over `client_procs` client processes (so that the clients
never compete for a GIL with an in-process server, and several cores can read the streams),
started together, their records merged in request order.

A client is `python -m kipp_core.loadgen` on a socket of its own rather than a multiprocessing
child: spawn would re-import the caller's __main__, which a script without a main guard cannot
survive.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np

from kipp_core.loadgen.driver import Share
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
    """Every request's record as arrays in request order (driver.pack's fields), the run's
    duration (from the start to the last request's end), and how busy the clients were: near 1,
    a client process was the bottleneck and its latencies include its own delay."""

    records: dict
    duration: float
    client_busy: float = 0.0  # the busiest client process's CPU time over the duration


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

    procs, conns, parts = [], [], None
    try:
        for share in _shares(spec, prompts, max_tokens, warmup):
            proc, conn = _start_client()
            procs.append(proc)
            conns.append(conn)
            conn.send((spec, share))
        parts = _gather(spec, procs, conns, len(prompts), tqdm)
    finally:
        for conn in conns:
            conn.close()
        for p in procs:  # each has sent its records and is exiting; after a failure, stop them
            if parts is None:
                p.kill()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    merged = _merge(parts)
    duration = float(np.max(merged["done"], initial=0.0))
    busy = float(np.max(merged["cpu_s"])) / duration if duration > 0 else 0.0
    return LoadResult(merged, duration, busy)


def _start_client() -> tuple[subprocess.Popen, Connection]:
    ours, theirs = socket.socketpair()
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the directory that holds kipp_core
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    fd = theirs.fileno()
    cmd = [sys.executable, "-m", "kipp_core.loadgen", str(fd)]
    proc = subprocess.Popen(cmd, pass_fds=[fd], env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    return proc, Connection(ours.detach())


def _recv(conn, proc) -> tuple:
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        raise ValueError(f"a client process died (exit code {proc.poll()})") from None
    if msg[0] == "error":
        raise ValueError(f"load client failed: {msg[1]}")
    return msg


def _gather(spec: LoadSpec, procs, conns, total: int, tqdm) -> list[dict]:
    for conn, proc in zip(conns, procs):  # warm-ups done, bodies built: every client is ready
        _recv(conn, proc)
    start = time.time() + START_DELAY_S
    for conn in conns:
        conn.send(start)
    parts: dict[int, dict] = {}
    finished = [0] * len(conns)
    off = None if spec.progress else True  # tqdm: None = on where stderr is a terminal
    with tqdm(total=total, desc=spec.desc, unit="req", disable=off) as bar:
        while len(parts) < len(conns):
            for conn in wait([c for i, c in enumerate(conns) if i not in parts], timeout=1.0):
                i = conns.index(conn)
                msg = _recv(conn, procs[i])
                if msg[0] == "progress":
                    finished[i] = msg[1]
                else:
                    parts[i], finished[i] = msg[1], len(msg[1]["index"])
            bar.update(sum(finished) - bar.n)
    return [parts[i] for i in range(len(conns))]
