"""`kipp generate`: one prompt in, streamed text out (or one JSON object with --json)."""

from __future__ import annotations

import json
import sys
import uuid

from kipp_core.cli.common import (
    Parser,
    UsageError,
    add_model_args,
    add_thinking_budget,
    bad,
    check_model_args,
    load_llm,
    positive_int,
    setup_logging,
)

DEFAULT_MAX_TOKENS = 256
TINY_MAX_TOKENS = 32  # its random text says nothing more at 256

EPILOG = """examples:
  kipp generate "Write a haiku about the sea"
  kipp generate --chat "Why is the sky blue?" --max-tokens 64 --temperature 0
  echo "Once upon a time" | kipp generate --json --seed 1
  kipp generate --model qwen3-0.6b --backend cuda --chat --no-think "Hello"
"""


def build_parser() -> Parser:
    p = Parser(
        prog="kipp generate",
        description="Generate text from a prompt.",
        epilog=EPILOG,
        formatter_class=__import__("argparse").RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", nargs="?", help="the prompt (read from stdin when omitted)")
    s = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    s.add_argument(
        "--max-tokens",
        "-n",
        type=positive_int,
        default=None,
        help=f"tokens to generate (default {DEFAULT_MAX_TOKENS}, {TINY_MAX_TOKENS} for kipp-tiny; "
        "capped by the context)",
    )
    s.add_argument("--temperature", "-t", type=float, default=None, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--min-p", type=float, default=None)
    s.add_argument("--repetition-penalty", type=float, default=None)
    s.add_argument("--presence-penalty", type=float, default=None)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    c = p.add_argument_group("chat")
    c.add_argument("--chat", action="store_true", help="render the prompt as one user turn")
    c.add_argument("--system", default=None, help="system prompt (with --chat)")
    c.add_argument("--no-think", action="store_true", help="disable thinking (with --chat)")
    add_thinking_budget(c, "a thought the prompt or the output opens")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: text, token_ids, prompt_token_ids, finish_reason",
    )
    add_model_args(p)
    return p


def sampling_overrides(args) -> dict:
    kw = {}
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "seed",
        "stop",
    ):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    if args.ignore_eos:
        kw["ignore_eos"] = True
    if args.thinking_budget is not None:
        kw["thinking_token_budget"] = args.thinking_budget
    return kw


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    prog = "kipp generate"
    for flag, given in (("--system", args.system is not None), ("--no-think", args.no_think)):
        if given and not args.chat:
            raise bad(prog, flag, "needs --chat")
    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
        prompt = prompt[:-1] if prompt.endswith("\n") else prompt  # echo's, not the prompt's
    if prompt is None or not prompt.strip():
        raise UsageError(f"{prog}: error: the prompt is empty")
    setup_logging(args.verbose)
    check_model_args(args, prog)
    llm = load_llm(args)
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": prompt})
        prompt = llm.chat_template.render(messages, enable_thinking=not args.no_think)
    ids = llm.tokenizer.encode(prompt)
    limit = llm.engine.max_model_len
    if len(ids) >= limit:
        raise ValueError(f"the prompt has {len(ids)} tokens, but the context holds {limit}")
    tiny = llm.registry_entry is not None and llm.registry_entry.name == "kipp-tiny"
    default = TINY_MAX_TOKENS if tiny else DEFAULT_MAX_TOKENS
    max_tokens = args.max_tokens if args.max_tokens is not None else min(default, limit - len(ids))
    params = llm.default_sampling_params(max_tokens=max_tokens, **sampling_overrides(args))
    engine = llm.engine
    engine.add_request(uuid.uuid4().hex, ids, params, prompt=prompt)
    final = None
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not args.json and out.outputs[0].text_delta:
                    sys.stdout.write(out.outputs[0].text_delta)
                    sys.stdout.flush()
                if out.finished:
                    final = out
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 130
    if args.json:
        print(
            json.dumps(
                {
                    "text": final.text,
                    "token_ids": final.token_ids,
                    "prompt_token_ids": ids,
                    "finish_reason": final.finish_reason,
                },
                ensure_ascii=False,
            )
        )
    else:
        sys.stdout.write("\n")
    return 0
