"""`kipp chat`: each turn computes only the new suffix (the prefix cache serves the history), the
KV reuse changes nothing in the reply, Ctrl-C keeps a partial reply, thinking is split, and the
REPL works with piped stdin."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys

import pytest

from kipp_core.chat import render
from kipp_core.cli.chat import ChatSession, Printer
from kipp_core.llm import LLM
from kipp_core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kipp_core.registry import IM_END_ID
from kipp_core.sampling import SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(str(tiny_path))


def test_turns_compute_only_the_suffix(llm):
    bs = llm.engine.block_manager.block_size
    s = ChatSession(llm, system="Be brief.", enable_thinking=False, max_tokens=40, **GREEDY)
    first = s.turn("Hello, who are you?")
    assert first.metrics.num_cached_tokens == 0
    for user in ["Tell me more about the sea.", "And the mountains?", "Thanks."]:
        history = list(s.token_ids)
        assert history[-1] == IM_END_ID
        m = s.turn(user).metrics
        suffix = m.num_prompt_tokens - len(history)
        # Every full block of the history whose KV was computed (all but the last sampled token,
        # <|im_end|>) comes from the cache; only the partial block and the new turn are computed.
        assert m.num_cached_tokens == (len(history) - 1) // bs * bs
        assert m.num_prompt_tokens - m.num_cached_tokens <= bs + suffix
        assert suffix < 30
    assert m.num_cached_tokens >= 3 * 40  # the history grew past several replies


def test_suffix_tokens_follow_the_template_and_reuse_changes_nothing(llm, tiny_path):
    s = ChatSession(llm, enable_thinking=False, max_tokens=40, **GREEDY)
    r1 = s.turn("Hi there")
    ids = s.prompt_token_ids("What did I say?")
    tok = llm.tokenizer
    # The template's rendering of the first turn, the reply as generated, then the new turn as the
    # template writes a user turn and a thinking-off generation prompt.
    first = render([{"role": "user", "content": "Hi there"}], enable_thinking=False)
    want = (
        first
        + r1.content
        + "<|im_end|>"
        + render([{"role": "user", "content": "What did I say?"}], enable_thinking=False).replace(
            "<|im_start|>", "\n<|im_start|>", 1
        )
    )
    assert tok.decode(ids) == want
    r2 = s.turn("What did I say?")
    assert r2.metrics.num_cached_tokens > 0
    cold = LLM(str(tiny_path), enable_prefix_caching=False)
    ref = cold.generate([ids], SamplingParams(max_tokens=40, **GREEDY))[0]
    assert r2.content == ref.text


def test_abort_keeps_the_partial_reply(llm):
    s = ChatSession(llm, enable_thinking=False, max_tokens=50, **GREEDY)
    calls = iter(range(100))
    t = s.turn("Count to a hundred, " * 8, should_stop=lambda: next(calls) >= 4)
    assert t.finish_reason == "abort"
    assert 0 < t.metrics.num_output_tokens < 50
    assert s.token_ids[-1] == IM_END_ID
    assert s.messages[-1] == {"role": "assistant", "content": t.content}
    assert not llm.engine.has_unfinished_requests()
    nxt = s.turn("Go on")
    assert nxt.finish_reason == "length" and nxt.metrics.num_cached_tokens > 0
    llm.engine.block_manager.check_all_free()


class ScriptedEngine:
    """Replays one reply as text deltas (the model here is random and never thinks)."""

    max_model_len = 4096

    def __init__(self, deltas):
        self.deltas, self.rid = list(deltas), None

    def add_request(self, rid, ids, params):
        self.rid, self.n = rid, len(ids)

    def has_unfinished_requests(self):
        return bool(self.deltas)

    def abort_request(self, rid):
        return False

    def step(self):
        d = self.deltas.pop(0)
        done = not self.deltas
        out = CompletionOutput(0, token_ids=[7, 8, IM_END_ID] if done else [], text_delta=d)
        out.finish_reason = "stop" if done else None
        out.text = "".join(SCRIPT[: len(SCRIPT) - len(self.deltas)])
        return [RequestOutput(self.rid, [], [out], done, RequestMetrics(0.0))]


SCRIPT = ["<thi", "nk>\nLet me", " think.\n</th", "ink>\n\nThe answer", " is 4."]


def test_thinking_is_split_streamed_and_saved(llm, tmp_path):
    class Fake:
        tokenizer, registry_entry, chat_template = llm.tokenizer, None, llm.chat_template
        engine = ScriptedEngine(SCRIPT)

        def default_sampling_params(self, **kw):
            return SamplingParams(**kw)

    s = ChatSession(Fake(), enable_thinking=True)
    buf = io.StringIO()
    p = Printer(buf, is_tty=False)
    t = s.turn("2+2?", p.delta)
    p.end()
    assert t.reasoning == "Let me think." and t.content == "The answer is 4."
    assert buf.getvalue() == "<think>\nLet me think.\n</think>\n\nThe answer is 4.\n"
    tty = io.StringIO()
    p = Printer(tty, is_tty=True)
    p.delta("hmm", "")
    p.delta("", "yes")
    p.end()
    assert tty.getvalue() == "\x1b[2mhmm\x1b[0m\n\nyes\n"
    s.save(tmp_path / "c.json")
    assert json.loads((tmp_path / "c.json").read_text()) == [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "The answer is 4.", "reasoning_content": "Let me think."},
    ]


def test_piped_stdin_repl(tiny_path, tmp_path):
    saved = tmp_path / "conv.json"
    script = f"Hello\n/think off\nWhat did I say?\n\n/bogus\n/save {saved}\nOne more\n"
    p = subprocess.run(
        [sys.executable, "-m", "kipp_core.cli.main", "chat", "--model", str(tiny_path)]
        + ["--backend", "oracle", "-n", "40", "--temperature", "0", "--stats", "--hide-thinking"],
        input=script,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    stats = re.findall(r"\((\d+) cached, (\d+) computed\)", p.stderr)
    assert len(stats) == 3 and int(stats[0][0]) == 0
    assert int(stats[1][0]) > 0 and int(stats[2][0]) > int(stats[1][0])
    assert "(thinking off)" in p.stderr and "unknown command /bogus" in p.stderr
    msgs = json.loads(saved.read_text())
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 2
    assert msgs[2]["content"] == "What did I say?"
    assert "\x1b[" not in p.stdout  # plain text when not on a terminal


def test_thinking_2507_turns_open_the_think_block(tiny_path, tmp_path):
    # Thinking-2507's generation prompt opens <think> on every turn, whatever /think says
    from kipp_core.vocab import chat_template
    from tests.server.conftest import with_template

    path = with_template(tiny_path, tmp_path / "t2507", chat_template("qwen3-thinking-2507"))
    s = ChatSession(LLM(str(path)), enable_thinking=False, max_tokens=4, **GREEDY)
    assert s.thinking() == (True, True)
    s.turn("Hi there")
    text = s.llm.tokenizer.decode(s.prompt_token_ids("Again"))
    assert text.endswith(
        "<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def test_thinking_budget_of_each_reply(tiny_path, tmp_path):
    """Thinking-2507 thinks from the first token: with --thinking-budget 1 the saved reply holds
    one token of reasoning, then the forced close, then an answer (without it, the random model
    thinks for all 8 tokens and answers nothing)."""
    from kipp_core.tokenizer import Tokenizer
    from kipp_core.vocab import chat_template
    from tests.server.conftest import with_template

    path = with_template(tiny_path, tmp_path / "t2507", chat_template("qwen3-thinking-2507"))
    tok = Tokenizer(path)
    for flag, budgeted in (([], False), (["--thinking-budget", "1"], True)):
        saved = tmp_path / f"conv{len(flag)}.json"
        p = subprocess.run(
            [sys.executable, "-m", "kipp_core.cli.main", "chat", "--model", str(path), *flag]
            + ["--backend", "oracle", "-n", "8", "--temperature", "0"],
            input=f"Hi\n/save {saved}\n",
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stderr
        reply = json.loads(saved.read_text())[1]
        if budgeted:
            assert len(tok.encode(reply["reasoning_content"])) <= 1 and reply["content"]
        else:
            assert len(tok.encode(reply["reasoning_content"])) > 4 and not reply["content"]


def test_an_empty_line_on_a_terminal_does_not_quit(tiny_path, tmp_path, monkeypatch, capsys):
    """At the prompt, Enter alone does nothing (input() gives ""); only Ctrl-D (EOFError) or
    /exit quits. Unknown commands say so; /help lists the commands."""
    from kipp_core.cli import chat

    saved = tmp_path / "conv.json"
    lines = iter(["", "Hello", "", "   ", "/nope", "/help", f"/save {saved}"])

    def fake_input(prompt=""):
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    monkeypatch.setattr("builtins.input", fake_input)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    args = ["--model", str(tiny_path), "--backend", "oracle", "-n", "4", "--no-think"]
    assert chat.main(args) == 0
    msgs = json.loads(saved.read_text())
    assert [m["role"] for m in msgs] == ["user", "assistant"]
    err = capsys.readouterr().err
    assert "unknown command /nope" in err and "/reset  /system" in err
