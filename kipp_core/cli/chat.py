"""`kipp chat`: a multi-turn REPL in the checkpoint's chat format, streamed, with reused KV.

The conversation is kept as the exact tokens the model has seen: the rendered first prompt, then
the tokens it generated (closed by <|im_end|>), then each new user turn appended as tokens (with
the template's own generation prompt: Thinking-2507's opens the think block). The
prefix cache publishes full blocks, generated ones included, so every earlier turn is served from
it and only the new suffix is computed: time to first token does not grow with the history. The
official template would drop earlier turns' reasoning when re-rendering the history; like the chat
loops of llama.cpp and mlx-lm, the REPL keeps the exact tokens instead.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kipp_core.chat_template import opens_think
from kipp_core.cli.common import (
    Parser,
    add_model_args,
    add_thinking_budget,
    check_model_args,
    load_llm,
    positive_int,
    setup_logging,
)
from kipp_core.outputs import RequestMetrics
from kipp_core.registry import ENDOFTEXT_ID, IM_END_ID
from kipp_core.server.reasoning import ReasoningStream, split_reasoning

HELP = (
    "/reset  /system TEXT  /think on|off  /save FILE  /help  /exit   "
    "(Ctrl-C stops a reply, Ctrl-D exits)"
)
EPILOG = """examples:
  kipp chat
  kipp chat --model qwen3-4b --backend mlx --system "You are terse."
  kipp chat --no-think --temperature 0 --stats
  printf 'Hi!\\nWhat did I just say?\\n' | kipp chat --no-think --max-tokens 64

In the REPL: /reset starts over, /system TEXT sets the system prompt (and starts over),
/think on|off switches thinking for the next turns, /save FILE writes the conversation as JSON
(OpenAI messages, with reasoning_content). Ctrl-C stops the current reply (the partial reply stays
in the conversation); Ctrl-D exits. With input piped on stdin each line is one user turn.
"""


@dataclass
class Turn:
    content: str
    reasoning: str | None
    finish_reason: str | None  # "stop" | "length" | "abort"
    metrics: RequestMetrics


class ChatSession:
    """A conversation held as tokens; each `turn` computes only the new suffix."""

    def __init__(
        self,
        llm,
        system: str | None = None,
        enable_thinking: bool = True,
        max_tokens: int | None = None,
        **sampling,
    ):
        self.llm = llm
        self.system = system
        self.enable_thinking = enable_thinking
        self.max_tokens = max_tokens
        self.sampling = sampling  # SamplingParams overrides
        self.reset()

    def reset(self) -> None:
        self.token_ids: list[int] = []
        self.messages: list[dict] = (
            [{"role": "system", "content": self.system}] if self.system else []
        )

    def generation_prompt(self) -> str:
        """What the template appends after a user turn (Qwen3's: `<|im_start|>assistant\\n`, and
        an empty think block with thinking off), found by rendering with and without it."""
        t, msgs = self.llm.chat_template, [{"role": "user", "content": "x"}]
        full = t.render(msgs, None, True, self.enable_thinking)
        head = t.render(msgs, None, False, self.enable_thinking)
        return full[len(head) :] if full.startswith(head) else "<|im_start|>assistant\n"

    def thinking(self) -> tuple[bool, bool]:
        """(the reply holds reasoning, the prompt opened its think block)."""
        opened = opens_think(self.generation_prompt())
        return opened or self.llm.chat_template.thinking(self.enable_thinking), opened

    def prompt_token_ids(self, user: str) -> list[int]:
        """The whole conversation with `user` appended as the next turn, as tokens."""
        if not self.token_ids:
            msgs = self.messages + [{"role": "user", "content": user}]
            prompt = self.llm.chat_template.render(msgs, None, True, self.enable_thinking)
            return self.llm.tokenizer.encode(prompt)
        # Special tokens split pre-tokenization, so the suffix encodes as it would in place.
        suffix = f"\n<|im_start|>user\n{user}<|im_end|>\n" + self.generation_prompt()
        return self.token_ids + self.llm.tokenizer.encode(suffix)

    def sampling_params(self, num_prompt_tokens: int):
        llm = self.llm
        room = llm.engine.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"the conversation has {num_prompt_tokens} tokens and fills the context of "
                f"{llm.engine.max_model_len}; /reset to start over"
            )
        kw = {}
        entry = llm.registry_entry
        if not self.enable_thinking and entry is not None and not entry.is_base:
            s = entry.sampling_non_thinking  # the model card's non-thinking defaults
            kw = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
        kw.update(self.sampling)
        kw["max_tokens"] = min(self.max_tokens or room, room)
        return llm.default_sampling_params(**kw)

    def turn(
        self,
        user: str,
        on_delta: Callable[[str, str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Turn:
        """Run one user turn; `on_delta(reasoning, content)` gets the streamed text. When
        `should_stop()` turns true (or on KeyboardInterrupt) the reply is aborted and kept."""
        ids = self.prompt_token_ids(user)
        params = self.sampling_params(len(ids))
        engine, rid = self.llm.engine, uuid.uuid4().hex
        engine.add_request(rid, ids, params)
        split = ReasoningStream(*self.thinking())
        final = None
        try:
            while final is None:
                if should_stop is not None and should_stop():
                    engine.abort_request(rid)
                for out in engine.step():
                    if on_delta is not None and out.outputs[0].text_delta:
                        on_delta(*split.feed(out.outputs[0].text_delta))
                    if out.finished:
                        final = out
        except KeyboardInterrupt:  # without the REPL's SIGINT handler
            engine.abort_request(rid)
            final = next((o for o in engine.step() if o.request_id == rid), None)
            if final is None:
                raise
        tail = split.finish()
        if on_delta is not None and any(tail):
            on_delta(*tail)
        return self._record(user, ids, final)

    def _record(self, user: str, ids: list[int], final) -> Turn:
        out = final.outputs[0]
        generated = list(out.token_ids)
        if generated and generated[-1] == ENDOFTEXT_ID:
            generated.pop()  # keep the template's shape: every turn ends with <|im_end|>
        if not generated or generated[-1] != IM_END_ID:
            generated.append(IM_END_ID)  # a cut-off or aborted reply is closed and kept
        self.token_ids = ids + generated
        reasoning, content = split_reasoning(out.text, *self.thinking())
        msg = {"role": "assistant", "content": content}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        self.messages += [{"role": "user", "content": user}, msg]
        return Turn(content, reasoning, out.finish_reason, final.metrics)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.messages, f, ensure_ascii=False, indent=2)
            f.write("\n")


class Printer:
    """Streams a reply: reasoning dimmed on a terminal, between <think> tags otherwise."""

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, out, is_tty: bool, show_thinking: bool = True):
        self.out, self.is_tty, self.show_thinking = out, is_tty, show_thinking
        self.phase = None  # None, "reasoning" or "content"

    def delta(self, reasoning: str, content: str) -> None:
        if reasoning and self.show_thinking:
            if self.phase is None:
                self.out.write(self.DIM if self.is_tty else "<think>\n")
                self.phase = "reasoning"
            self.out.write(reasoning)
        if content:
            if self.phase == "reasoning":
                self.out.write(self.RESET + "\n\n" if self.is_tty else "\n</think>\n\n")
            self.phase = "content"
            self.out.write(content)
        self.out.flush()

    def end(self) -> None:
        if self.phase == "reasoning":
            self.out.write(self.RESET if self.is_tty else "\n</think>")
        self.out.write("\n")
        self.out.flush()
        self.phase = None


def build_parser() -> Parser:
    p = Parser(
        prog="kipp chat",
        description="Chat with a model; the KV of earlier turns is reused.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--no-think", action="store_true", help="start with thinking off")
    p.add_argument("--hide-thinking", action="store_true", help="do not print the reasoning")
    add_thinking_budget(p, "each reply's")
    p.add_argument(
        "--max-tokens",
        "-n",
        type=positive_int,
        default=None,
        help="tokens per reply (default: up to the context)",
    )
    p.add_argument("--temperature", "-t", type=float, default=None, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--stats",
        action="store_true",
        help="after each reply print TTFT, cached and computed tokens (stderr)",
    )
    add_model_args(p)
    return p


def run_command(session: ChatSession, line: str, out) -> bool:
    """Handle a /command; False means exit."""
    cmd, _, arg = line.partition(" ")
    arg = arg.strip()
    if cmd in ("/exit", "/quit"):
        return False
    if cmd == "/reset":
        session.reset()
        print("(conversation cleared)", file=out)
    elif cmd == "/system":
        session.system = arg or None
        session.reset()
        print(f"(system prompt {'set' if arg else 'cleared'}; new conversation)", file=out)
    elif cmd == "/think" and arg in ("on", "off"):
        session.enable_thinking = arg == "on"
        print(f"(thinking {arg})", file=out)
    elif cmd == "/save" and arg:
        try:
            session.save(arg)
            print(f"(saved {len(session.messages)} messages to {arg})", file=out)
        except OSError as e:
            print(f"error: cannot write {arg}: {e.strerror}", file=out)
    elif cmd in ("/think", "/save"):
        print(f"usage: {cmd} {'on|off' if cmd == '/think' else 'FILE'}", file=out)
    elif cmd == "/help":
        print(HELP, file=out)
    else:
        print(f"unknown command {cmd} (/help lists them)", file=out)
    return True


def _reply(session: ChatSession, user: str, printer: Printer) -> Turn:
    stop = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()
    # Ctrl-C sets a flag checked between engine steps, so a step is never cut in half.
    old = signal.signal(signal.SIGINT, lambda *_: stop.set()) if in_main else None
    try:
        return session.turn(user, printer.delta, stop.is_set)
    finally:
        if in_main:
            signal.signal(signal.SIGINT, old)
        printer.end()


def _stats(turn: Turn) -> str:
    m = turn.metrics
    ttft = f"{m.ttft * 1000:.1f} ms" if m.ttft is not None else "-"
    dt = m.decode_time
    rate = f", {(m.num_output_tokens - 1) / dt:.1f} tok/s" if dt and m.num_output_tokens > 1 else ""
    return (
        f"[ttft {ttft}, {m.num_prompt_tokens} prompt tokens ({m.num_cached_tokens} cached, "
        f"{m.num_prompt_tokens - m.num_cached_tokens} computed), {m.num_output_tokens} "
        f"generated{rate}, {turn.finish_reason}]"
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    check_model_args(args, "kipp chat")
    llm = load_llm(args)
    sampling = {
        k: getattr(args, k)
        for k in ("temperature", "top_p", "top_k", "seed")
        if getattr(args, k) is not None
    }
    if args.thinking_budget is not None:
        sampling["thinking_token_budget"] = args.thinking_budget
    session = ChatSession(llm, args.system, not args.no_think, args.max_tokens, **sampling)
    llm.default_sampling_params(**sampling)  # bad values fail here, not on the first turn
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(
            f"kipp chat: {llm.checkpoint.path.name} on {llm.backend_name}. {HELP}", file=sys.stderr
        )
    printer = Printer(sys.stdout, sys.stdout.isatty(), not args.hide_thinking)
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        except EOFError:  # Ctrl-D
            print(file=sys.stderr)
            return 0
        if not interactive and not line:  # the end of piped input (an empty line is "\n")
            return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.startswith("/"):
            if not run_command(session, line.strip(), sys.stderr):
                return 0
            continue
        try:
            turn = _reply(session, line, printer)
        except ValueError as e:  # the conversation no longer fits: say so and go on
            print(f"kipp chat: error: {e}", file=sys.stderr)
            continue
        if args.stats:
            print(_stats(turn), file=sys.stderr)
        if turn.finish_reason == "abort":
            print("(stopped)", file=sys.stderr)
