"""`kipp serve` failures: one line on stderr and exit 2, whether found at parse time or while the
model loads behind the already-bound socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kipp_core.cli.main", "serve", *args]
    if "--port" not in args:
        cmd += ["--port", "0"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=dict(os.environ))


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--model", "no-such-model-xyz", "--backend", "oracle"), "unknown model"),
        (("--port", "70000"), "--port"),
        (("--max-waiting", "0"), "--max-waiting"),
    ],
)
def test_serve_errors_exit_2_with_one_line(args, says):
    check_one_error_line(serve(*args), says)


def test_port_in_use_exits_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = serve("--port", str(taken.getsockname()[1]))
    check_one_error_line(r, "cannot listen")


def check_one_error_line(r: subprocess.CompletedProcess, says: str) -> None:
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in r.stderr


def test_a_model_that_does_not_exist_fails_before_serving():
    r = serve("--model", "nope", "--backend", "oracle")
    check_one_error_line(r, "unknown model")
    assert "serving" not in r.stderr  # it once announced the server first
