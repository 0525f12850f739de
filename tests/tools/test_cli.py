"""The tool commands as a user runs them: --help exits 0 with examples, bad arguments exit 2 with
one line and no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = ["chat", "ppl", "quantize", "bench"]


def kipp(*args, stdin: str = ""):
    return subprocess.run(
        [sys.executable, "-m", "kipp_core.cli.main", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=120,
    )


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_has_examples(cmd):
    p = kipp(cmd, "--help")
    assert p.returncode == 0
    assert "examples:" in p.stdout and f"\n  kipp {cmd} " in p.stdout


BAD = [
    ("ppl",),  # --file is required
    ("ppl", "--file", "/nonexistent/wiki.raw"),
    ("ppl", "--file", __file__, "--ctx", "1"),
    ("ppl", "--file", __file__, "--ctx", "8", "--stride", "9"),
    ("quantize", "--model", "kipp-tiny", "--scheme", "q4_k", "--out", "/tmp/x"),
    (
        "quantize",
        "--model",
        "kipp-tiny",
        "--scheme",
        "affine4",
        "--group-size",
        "64",
        "--out",
        "/tmp/kipp-test-never-written",
    ),
    ("quantize", "--model", "/nonexistent", "--scheme", "q8_0", "--out", "/tmp/kipp-never"),
    ("bench", "--batch-sizes", "0"),
    ("bench", "--batch-sizes", "1,x"),
    ("bench", "--peers", "llama.cpp"),
    ("bench", "--gen-len", "1"),
    ("bench", "--random-weights", "qwen3-9b"),
    ("chat", "--max-tokens", "0"),
    ("chat", "--temperature", "-1"),
    ("chat", "--backend", "tpu"),
    ("chat", "--rope-scaling", "{bad"),
    ("chat", "--rope-scaling", '{"rope_type": "dynamic", "factor": 2}'),
    ("chat", "--max-model-len", "8192"),  # kipp-tiny has no YaRN recipe
]


@pytest.mark.parametrize("args", BAD, ids=[" ".join(a) for a in BAD])
def test_bad_arguments_exit_2_with_one_line(args):
    p = kipp(*args)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if not x.startswith("kipp: ")]  # log lines
    assert len(lines) == 1 and lines[0].startswith(f"kipp {args[0]}"), p.stderr
