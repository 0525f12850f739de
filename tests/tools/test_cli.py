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


# Each value the CLI once ran with (or failed on with a traceback, or explained in terms of
# something else), and the flag its one line must name. Every backend, one message style.
NAMED = [
    (("bench", "--repeats", "0"), "--repeats"),  # was an IndexError after loading
    (("quantize", "--model", "kipp-tiny", "--scheme", "q8_0", "--out", "/proc/kipp/x"), "--out"),
    (("generate", "hi", "--backend", "oracle", "--kv-cache-memory", "banana"), "--kv-cache-memory"),
    (("generate", "hi", "--backend", "cuda", "--kv-cache-memory", "2.5"), "--kv-cache-memory"),
    (("generate", "hi", "--max-model-len", "0"), "--max-model-len"),  # ran
    (("generate", "hi", "--max-model-len", "-5"), "--max-model-len"),  # "need num_blocks > 0"
    (("generate", "hi", "--backend", "oracle", "-tp", "4"), "--tensor-parallel"),  # ran
    (("chat", "--backend", "mlx", "--tensor-parallel", "2"), "--tensor-parallel"),
    (("generate", "hi", "--system", "be brief"), "--system"),  # ignored without --chat
    (("generate", "hi", "--no-think"), "--no-think"),
    (("serve", "--max-body-mb", "0"), "--max-body-mb"),
    (("serve", "--default-max-tokens", "-1"), "--default-max-tokens"),
    (("serve", "--thinking-budget", "-1"), "--thinking-budget"),
    (("generate", "hi", "--thinking-budget", "many"), "--thinking-budget"),
    (("chat", "--thinking-budget", "1.5"), "--thinking-budget"),
    (("ppl", "--file", __file__, "--stride", "0"), "--stride"),
    (
        ("generate", "hi", "--speculative", "ngram", "--speculative-model", "x"),
        "--speculative-model",
    ),
]


@pytest.mark.parametrize(("args", "flag"), NAMED, ids=[" ".join(a) for a, _ in NAMED])
def test_every_bad_value_names_its_flag(args, flag):
    p = kipp(*args)
    assert p.returncode == 2, p.stderr
    lines = [x for x in p.stderr.splitlines() if not x.startswith("kipp: ")]
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith(f"kipp {args[0]}: error: argument {flag}"), lines[0]
