"""`kipp generate` as a user runs it: text and JSON on kipp-tiny, and exit code 2 with one line
for every kind of bad input."""

from __future__ import annotations

import json

import pytest

from tests.tools.test_cli import kipp


def test_help():
    p = kipp("generate", "--help")
    assert p.returncode == 0 and "examples:" in p.stdout


@pytest.mark.parametrize("chat", [False, True])
def test_json_output(chat, tiny_path):
    from kipp_core.chat import render
    from kipp_core.tokenizer import Tokenizer

    args = [
        "generate",
        "Write a haiku about the sea",
        "--json",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--backend",
        "oracle",
    ] + (["--chat"] if chat else [])
    p = kipp(*args)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"text", "token_ids", "prompt_token_ids", "finish_reason"}
    tok = Tokenizer(tiny_path)
    prompt = "Write a haiku about the sea"
    if chat:
        prompt = render([{"role": "user", "content": prompt}])
    assert out["prompt_token_ids"] == tok.encode(prompt)
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
    assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)


def test_text_output_and_stdin():
    p = kipp("generate", "--max-tokens", "4", "--backend", "oracle", stdin="Once upon a time")
    assert p.returncode == 0, p.stderr
    assert p.stdout.endswith("\n") and len(p.stdout) > 1


LONG = "word " * 5000  # > 4096 tokens, kipp-tiny's context

BAD = {
    "empty prompt": (["generate", "   "], None),
    "missing model": (["generate", "hi", "--model", "/no/such/dir"], None),
    "bad int": (["generate", "hi", "--max-tokens", "x"], None),
    "zero max tokens": (["generate", "hi", "--max-tokens", "0"], None),
    "bad temperature": (["generate", "hi", "--temperature", "-1", "--backend", "oracle"], None),
    "too long": (["generate", "--backend", "oracle"], LONG),
    "unknown backend": (["generate", "hi", "--backend", "tpu"], None),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_exits_2_with_one_line(name):
    args, stdin = BAD[name]
    p = kipp(*args, stdin=stdin or "")
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if not x.startswith("kipp: ")]  # log lines
    assert len(lines) == 1 and lines[0].startswith("kipp generate"), p.stderr
    if name == "too long":
        assert "context holds 4096" in lines[0]


def test_kipp_tiny_says_its_weights_are_random_and_stays_short(tiny_path):
    """The embedded default writes gibberish: one stderr note says why (and --help does), and
    without --max-tokens it writes 32 tokens, not 256."""
    from kipp_core.cli.generate import TINY_MAX_TOKENS

    p = kipp("generate", "Write a haiku", "--json", "--backend", "oracle", "--ignore-eos")
    assert p.returncode == 0, p.stderr
    notes = [x for x in p.stderr.splitlines() if "random weights" in x]
    assert len(notes) == 1 and notes[0].startswith("kipp: kipp-tiny")
    assert len(json.loads(p.stdout)["token_ids"]) == TINY_MAX_TOKENS == 32
    assert "random weights" in " ".join(kipp("generate", "--help").stdout.split())


def test_a_prompt_from_stdin_loses_the_newline_echo_adds(tiny_path):
    from kipp_core.tokenizer import Tokenizer

    p = kipp("generate", "--json", "-n", "1", "--backend", "oracle", stdin="Once upon a time\n")
    assert json.loads(p.stdout)["prompt_token_ids"] == Tokenizer(tiny_path).encode(
        "Once upon a time"
    )


def test_backend_auto_says_which_it_picked():
    p = kipp("generate", "hi", "-n", "1", "--backend", "auto")
    assert p.returncode == 0, p.stderr
    assert "kipp: backend auto: " in p.stderr


def test_thinking_budget_closes_an_opened_thought(tiny_path):
    """A prompt that opens the thought: after 2 tokens of it come `\\n</think>\\n\\n` (without
    the flag, the random model would go on thinking)."""
    from kipp_core.thinking_budget import CLOSING
    from kipp_core.tokenizer import Tokenizer

    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    args = ["generate", prompt, "--json", "-n", "7", "--temperature", "0", "--backend", "oracle"]
    closing = Tokenizer(tiny_path).encode(CLOSING)
    for flag, closed in (([], False), (["--thinking-budget", "2"], True)):
        p = kipp(*args, *flag)
        assert p.returncode == 0, p.stderr
        assert (json.loads(p.stdout)["token_ids"][2:5] == closing) is closed
