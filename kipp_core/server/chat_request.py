"""Reading a /v1/chat/completions body into a prompt and SamplingParams.

The prompt is the checkpoint's chat template (kipp_core.chat_template) rendered over the messages;
whether the output holds reasoning follows the template (Instruct-2507 never, Thinking-2507
always, Qwen3 by `enable_thinking`). `tool_choice: "none"` offers no tools and parses no calls; a
named function forces the call's opening, `<tool_call>\\n{"name": NAME, "arguments": `, after an
empty think block (closed by hand where the template opened one), holds the rest to arguments
valid for the function's
`parameters` (kipp_core/json_schema.py) and the call's close, and parses the output with that
prefix prepended (as vLLM's guided decoding of a named function always returns the call).
`"required"` forces `<tool_call>\\n` the same way and holds the output to one whole call of an
offered tool, with valid arguments (kipp_core/tool_constraint.py). `response_format`
`json_object` and `json_schema` hold the answer to JSON (after the thinking, when on). These are
SamplingParams.structured_outputs, which the engine compiles and applies; `check_structured`
compiles the schemas off the event loop first, so that a bad one is a 400 naming its field.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from kipp_core.chat_template import opens_think
from kipp_core.sampling import SamplingParams
from kipp_core.server.context import ServingContext
from kipp_core.server.errors import bad_request
from kipp_core.server.protocol import (
    COMMON_FIELDS,
    Fields,
    build_params,
    check_context,
    check_model,
    sampling_fields,
    stream_flags,
)
from kipp_core.structured_outputs import StructuredOutputs, StructuredOutputsError

FIELDS = (
    *COMMON_FIELDS,
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
    "modalities",
)
# OpenAI fields with no effect here, accepted so that clients setting them keep working.
IGNORED = (
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "verbosity",
    "reasoning_effort",
    "moderation",
)
UNSUPPORTED = ("audio", "prediction", "web_search_options", "functions", "function_call")
ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class ChatRequest:
    prompt: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    thinking: bool  # split reasoning_content out of the output
    parse_tools: bool
    tool_prefix: str  # forced opening of a named tool call, prepended before parsing
    logprobs: int | None  # top_logprobs when logprobs is on
    tool_index: dict[str, int] | None = None  # a forced call's names -> their index in tools
    think_opened: bool = False  # the prompt opened the think block (Thinking-2507)


def _text(content, where: str) -> str | None:
    """Message content as text: a string, or the text parts of a list joined by newlines."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of parts", "messages")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_request(
                f"{where}.content[{j}] must be a text part (only text is supported)", "messages"
            )
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{j}].text must be a string", "messages")
        texts.append(part["text"])
    return "\n".join(texts)  # as vLLM joins text parts


def parse_messages(raw) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        if m.get("role") not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}", "messages")
        m = dict(m)
        if m["role"] == "developer":  # OpenAI's newer name for the system role
            m["role"] = "system"
        m["content"] = _text(m.get("content"), f"messages[{i}]")
        if m["content"] is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            # as OpenAI: only an assistant message that calls tools may leave it out
            where = f"messages[{i}].content"
            raise bad_request(f"Missing required parameter: '{where}'", where)
        rc = m.get("reasoning_content")
        if rc is not None and not isinstance(rc, str):
            raise bad_request(f"messages[{i}].reasoning_content must be a string", "messages")
        out.append(m)
    return out


def parse_tools(raw) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("tools must be an array", "tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools"
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters must be an object", "tools")
    return raw


def _tool_choice(raw, tools: list[dict]) -> str | dict:
    """ "none", "auto", "required", or the named function's name (as {"name": ...})."""
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto"):
        return raw if tools else "none"
    if raw == "required":
        if not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return raw
    fn = raw.get("function") if isinstance(raw, dict) else None
    if (
        not isinstance(fn, dict)
        or raw.get("type") != "function"
        or not isinstance(fn.get("name"), str)
    ):
        raise bad_request(
            "tool_choice must be 'none', 'auto' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    names = [t["function"]["name"] for t in tools]
    if fn["name"] not in names:
        raise bad_request(f"tool_choice names {fn['name']!r}, which is not in tools", "tool_choice")
    return {"name": fn["name"]}


def parse_thinking(f: Fields) -> bool:
    kw = f.mapping("chat_template_kwargs", {})
    for key in kw:
        if key != "enable_thinking":
            raise bad_request(
                f"chat_template_kwargs.{key} is not supported (only enable_thinking)",
                "chat_template_kwargs",
            )
    value = kw.get("enable_thinking", True)
    if not isinstance(value, bool):
        raise bad_request(
            "chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs"
        )
    return value


def _json_format(f: Fields) -> tuple[bool, dict | bool | None]:
    """(constrained to JSON, the schema of a json_schema format or None)."""
    fmt = f.mapping("response_format")
    kind = None if fmt is None else fmt.get("type")
    if fmt is None or kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise bad_request(
                "response_format.json_schema must be an object with a name and a schema",
                "response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad_request(
                "response_format.json_schema.schema must be an object", "response_format"
            )
        return True, schema
    raise bad_request(
        f"response_format type {kind!r} is not supported (use 'text', 'json_object' or "
        "'json_schema')",
        "response_format",
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
        if e.tool is None:
            raise bad_request(
                f"response_format.json_schema.schema: {e.reason}", "response_format"
            ) from None
        i = req.tool_index[so.tools[e.tool][0]]
        raise bad_request(f"tools[{i}].function.parameters: {e.reason}", "tools") from None


def _structured(
    ctx: ServingContext, thinking: bool, json_object: bool, schema, tools, names, prefix: str
) -> StructuredOutputs | None:
    if ctx.front.speculative:
        if json_object or (names and prefix == "<tool_call>\n"):
            what = "response_format" if json_object else "tool_choice"
            raise bad_request(f"{what} is not available with speculative decoding", what)
        return None  # a named call: its forced opening alone (speculation has no masks)
    if json_object:
        start = ctx.tokenizer.token_to_id("</think>") if thinking else None
        if schema is None:
            return StructuredOutputs(json_object=True, start_after=start)
        return StructuredOutputs(json_schema=schema, start_after=start)
    if not names:
        return None
    params = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    opened = prefix != "<tool_call>\n"  # a named function: the prompt is past its name
    return StructuredOutputs(tools=tuple((n, params[n]) for n in names), tool_call_opened=opened)


def parse_request(body: dict, ctx: ServingContext) -> ChatRequest:
    f = Fields(body, FIELDS + UNSUPPORTED, IGNORED)
    for name in UNSUPPORTED:
        if f.has(name):
            raise bad_request(f"{name} is not supported", name)
    if f.raw("modalities", ["text"]) != ["text"]:
        raise bad_request("only the 'text' modality is supported", "modalities")
    check_model(f, (ctx.model_name,))
    stream, include_usage = stream_flags(f)
    f.string("user")
    f.boolean("parallel_tool_calls")  # Qwen3 may call several tools at once either way
    messages = parse_messages(f.raw("messages"))
    tools = parse_tools(f.raw("tools"))
    choice = _tool_choice(f.raw("tool_choice"), tools)
    enable_thinking = parse_thinking(f)
    json_object, json_schema = _json_format(f)
    max_param = "max_completion_tokens" if f.has("max_completion_tokens") else "max_tokens"
    max_tokens = f.integer(max_param, None, lo=1)  # None: the rest of the context (vLLM's)
    logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", lo=0, hi=20)
    if top is not None and not logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    kw = sampling_fields(f, ctx.vocab_size)

    prefix = ""
    forced = isinstance(choice, dict) or choice == "required"
    if forced and json_object:
        raise bad_request(
            "a json response_format cannot be combined with a forced tool_choice",
            "response_format",
        )
    if isinstance(choice, dict):  # the rest of the call is held to its grammar (tool_constraint)
        prefix = '<tool_call>\n{"name": ' + json.dumps(choice["name"], ensure_ascii=False)
        prefix += ', "arguments": '
    elif choice == "required":  # likewise, from the call's name on
        prefix = "<tool_call>\n"
    # a forced call starts the answer; thinking first would not fit it
    enable_thinking = enable_thinking and not forced
    template = ctx.chat_template
    try:
        prompt = template.render(
            messages, tools if choice != "none" else None, True, enable_thinking
        )
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    opened = opens_think(prompt)
    if forced:
        if opened:  # the template opened the block: close it empty, as Qwen3's does
            prompt += "\n</think>\n\n"
        opened = thinking = False
    else:
        thinking = opened or template.thinking(enable_thinking)
    prompt += prefix
    names = forced_names(choice, tools)
    ids = ctx.encode(prompt, "messages")  # off the event loop for a long one (offload.py)
    check_context(
        len(ids), max_tokens, ctx.max_model_len, "messages", max_param, kw.get("min_tokens", 0)
    )
    if max_tokens is None and ctx.default_max_tokens is not None:  # --default-max-tokens
        max_tokens = min(ctx.default_max_tokens, ctx.max_model_len - len(ids))
    kw["max_tokens"] = max_tokens
    kw["logprobs"] = (top or 0) if logprobs else None
    kw["structured_outputs"] = _structured(
        ctx, thinking, json_object, json_schema, tools, names, prefix
    )
    params = build_params(ctx.defaults, kw, {"max_tokens": max_param, "logprobs": "top_logprobs"})
    index = {t["function"]["name"]: i for i, t in enumerate(tools)} if names else None
    return ChatRequest(
        prompt,
        ids,
        params,
        stream,
        include_usage,
        thinking,
        choice != "none",
        prefix,
        kw["logprobs"],
        index,
        opened,
    )


def forced_names(choice, tools: list[dict]) -> list[str] | None:
    """The names a forced call may use: every offered tool ("required"), the named one, or None."""
    if isinstance(choice, dict):
        return [choice["name"]]
    return [t["function"]["name"] for t in tools] if choice == "required" else None
