"""The one request model behind Chat Completions, Messages and Responses: each front end reads its
body into a ChatSpec (messages in the chat template's shape, OpenAI function tools, a normalized
tool choice, thinking, the JSON format, the sampling fields), and `build_request` makes the
ChatRequest the engine runs: the prompt, its token ids and SamplingParams.

The prompt is the checkpoint's chat template (kipp_core.chat_template) rendered over the messages;
whether the output holds reasoning follows the template (Instruct-2507 never, Thinking-2507
always, Qwen3 by `enable_thinking`), and a thinking budget closes it in the engine
(kipp_core/thinking_budget.py). `tool_choice: "none"` offers no tools and parses no calls; a named
function forces the call's opening, `<tool_call>\\n{"name": NAME, "arguments": `, after an empty
think block (closed by hand where the template opened one), holds the rest to arguments valid for
the function's `parameters` (kipp_core/json_schema.py) and the call's close, and parses the output
with that prefix prepended (as vLLM's guided decoding of a named function always returns the call).
`"required"` forces `<tool_call>\\n` the same way and holds the output to one whole call of an
offered tool, with valid arguments (kipp_core/tool_constraint.py). A JSON format holds the answer
to JSON (after the thinking, when on). These are SamplingParams.structured_outputs, which the
engine compiles and applies; `check_structured` compiles the schemas off the event loop first, so
that a bad one is a 400 naming its field.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from kipp_core.chat_template import opens_think
from kipp_core.sampling import SamplingParams
from kipp_core.server.context import ServingContext
from kipp_core.server.errors import bad_request
from kipp_core.server.protocol import build_params, check_context
from kipp_core.structured_outputs import StructuredOutputs, StructuredOutputsError

# Responses' reasoning.effort and Messages' output_config.effort as thinking budgets: None is
# no budget, and "none" is no thinking.
EFFORT_BUDGETS = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 8192,
    "high": None,
    "xhigh": None,
    "max": None,
}


@dataclass(frozen=True)
class Names:
    """The request parameters a front end's errors name."""

    messages: str = "messages"
    max_tokens: str = "max_tokens"
    logprobs: str = "top_logprobs"
    format: str = "response_format"
    schema: str = "response_format.json_schema.schema"
    tool_schema: str = "tools[{}].function.parameters"
    tool_choice: str = "tool_choice"
    budget: str = "thinking_token_budget"


@dataclass
class ChatSpec:
    messages: list[dict]  # roles system, user, assistant, tool, as the chat template reads them
    tools: list[dict] = field(default_factory=list)  # OpenAI function tools
    tool_choice: str | dict = "none"  # "none", "auto", "required" or {"name": ...}
    enable_thinking: bool = True
    thinking_budget: int | None = None  # None: the server's --thinking-budget
    json_object: bool = False  # the answer is JSON: json_schema's schema, or any object
    json_schema: dict | bool | None = None
    max_tokens: int | None = None  # None: the rest of the context (or --default-max-tokens)
    sampling: dict = field(default_factory=dict)  # SamplingParams fields the body set
    logprobs: int | None = None  # top logprobs of each token, when logprobs are on
    stream: bool = False
    include_usage: bool = False
    names: Names = field(default_factory=Names)
    prefill: str | None = None  # the start of the answer, which the output continues
    include_reasoning: bool = True  # False: the reasoning is made but not returned (vLLM's)


@dataclass
class ChatRequest:
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    thinking: bool  # split reasoning out of the output
    parse_tools: bool
    tool_prefix: str  # forced opening of a named tool call, prepended before parsing
    logprobs: int | None  # top_logprobs when logprobs is on
    tool_index: dict[str, int] | None = None  # a forced call's names -> their index in tools
    think_opened: bool = False  # the prompt opened the think block (Thinking-2507)
    names: Names = field(default_factory=Names)
    include_reasoning: bool = True  # (Messages' thinking display "omitted": False)
    echo: dict = field(default_factory=dict)  # what the answer repeats of the body (Responses)


def tool_choice(raw, tools: list[dict], param: str = "tool_choice") -> str | dict:
    """OpenAI's tool_choice normalized: "none", "auto", "required", or {"name": ...}; `raw` is
    already one of those shapes, or None (the default)."""
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto"):
        return raw if tools else "none"
    if raw == "required":
        if not tools:
            raise bad_request(f"{param} 'required' needs tools", param)
        return raw
    names = [t["function"]["name"] for t in tools]
    if raw["name"] not in names:
        raise bad_request(f"{param} names {raw['name']!r}, which is not in tools", param)
    return {"name": raw["name"]}


def forced_names(choice, tools: list[dict]) -> list[str] | None:
    """The names a forced call may use: every offered tool ("required"), the named one, or None."""
    if isinstance(choice, dict):
        return [choice["name"]]
    return [t["function"]["name"] for t in tools] if choice == "required" else None


def _structured(ctx: ServingContext, spec: ChatSpec, thinking: bool, names, prefix: str):
    if ctx.front.speculative:
        if spec.json_object or (names and prefix == "<tool_call>\n"):
            what = spec.names.format if spec.json_object else spec.names.tool_choice
            raise bad_request(f"{what} is not available with speculative decoding", what)
        return None  # a named call: its forced opening alone (speculation has no masks)
    if spec.json_object:
        start = ctx.tokenizer.token_to_id("</think>") if thinking else None
        if spec.json_schema is None:
            return StructuredOutputs(json_object=True, start_after=start)
        return StructuredOutputs(json_schema=spec.json_schema, start_after=start)
    if not names:
        return None
    params = {t["function"]["name"]: t["function"].get("parameters") for t in spec.tools}
    opened = prefix != "<tool_call>\n"  # a named function: the prompt is past its name
    return StructuredOutputs(tools=tuple((n, params[n]) for n in names), tool_call_opened=opened)


def render_prompt(spec: ChatSpec, ctx: ServingContext) -> tuple[str, bool, bool, str]:
    """(prompt, thinking, the prompt opened the think block, the forced tool-call prefix)."""
    choice = spec.tool_choice
    forced = isinstance(choice, dict) or choice == "required"
    if spec.json_object and (forced or spec.prefill is not None):
        what = "a forced tool_choice" if forced else "an assistant prefill"
        raise bad_request(
            f"a json {spec.names.format} cannot be combined with {what}", spec.names.format
        )
    if forced and spec.prefill is not None:
        raise bad_request(
            f"an assistant prefill cannot be combined with a forced {spec.names.tool_choice}",
            spec.names.tool_choice,
        )
    prefix = ""
    if isinstance(choice, dict):  # the rest of the call is held to its grammar (tool_constraint)
        prefix = '<tool_call>\n{"name": ' + json.dumps(choice["name"], ensure_ascii=False)
        prefix += ', "arguments": '
    elif choice == "required":  # likewise, from the call's name on
        prefix = "<tool_call>\n"
    # a forced call or a prefill starts the answer; thinking first would not fit it
    forced = forced or spec.prefill is not None
    enable_thinking = spec.enable_thinking and not forced
    template = ctx.chat_template
    tools = spec.tools if choice != "none" else None
    try:
        prompt = template.render(spec.messages, tools or None, True, enable_thinking)
    except ValueError as e:
        raise bad_request(str(e), spec.names.messages) from None
    opened = opens_think(prompt)
    if forced:
        if opened:  # the template opened the block: close it empty, as Qwen3's does
            prompt += "\n</think>\n\n"
        opened = thinking = False
    else:
        thinking = opened or template.thinking(enable_thinking)
    return prompt + (spec.prefill or prefix), thinking, opened, prefix


def build_request(spec: ChatSpec, ctx: ServingContext) -> ChatRequest:
    """The engine's request for `spec` (a 400 naming the parameter for what cannot be served)."""
    prompt, thinking, opened, prefix = render_prompt(spec, ctx)
    names = forced_names(spec.tool_choice, spec.tools)
    ids = ctx.encode(prompt, spec.names.messages)  # off the event loop for a long one
    max_tokens = spec.max_tokens
    kw = dict(spec.sampling)
    check_context(
        len(ids),
        max_tokens,
        ctx.max_model_len,
        spec.names.messages,
        spec.names.max_tokens,
        kw.get("min_tokens", 0),
    )
    if max_tokens is None and ctx.default_max_tokens is not None:  # --default-max-tokens
        max_tokens = min(ctx.default_max_tokens, ctx.max_model_len - len(ids))
    kw["max_tokens"] = max_tokens
    kw["logprobs"] = spec.logprobs
    kw["structured_outputs"] = _structured(ctx, spec, thinking, names, prefix)
    budget = spec.thinking_budget
    if budget is None:
        budget = ctx.default_thinking_budget
    kw["thinking_token_budget"] = budget if thinking else None
    rename = {
        "max_tokens": spec.names.max_tokens,
        "logprobs": spec.names.logprobs,
        "thinking_token_budget": spec.names.budget,
    }
    params = build_params(ctx.defaults, kw, rename)
    index = {t["function"]["name"]: i for i, t in enumerate(spec.tools)} if names else None
    return ChatRequest(
        prompt,
        ids,
        params,
        spec.stream,
        spec.include_usage,
        thinking,
        spec.tool_choice != "none",
        prefix,
        spec.logprobs,
        index,
        opened,
        spec.names,
        spec.include_reasoning,
    )


async def check_structured(req: ChatRequest) -> None:
    """Compile the request's schemas off the event loop (StructuredOutputs keeps the result for
    the engine); a schema that does not compile, or is too large, is a 400 naming its field."""
    so = req.params.structured_outputs
    if so is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(None, so.compiled)
    except StructuredOutputsError as e:
        names = req.names
        if e.tool is None:
            raise bad_request(f"{names.schema}: {e.reason}", names.format) from None
        i = req.tool_index[so.tools[e.tool][0]]
        raise bad_request(f"{names.tool_schema.format(i)}: {e.reason}", "tools") from None
