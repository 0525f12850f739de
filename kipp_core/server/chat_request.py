"""Reading a /v1/chat/completions body into the ChatSpec all chat front ends share
(kipp_core/server/chat_spec.py): OpenAI messages, function tools and tool_choice, `thinking` from
`chat_template_kwargs.enable_thinking` with vLLM's `thinking_token_budget`, `response_format`
(json_object, json_schema), logprobs and the sampling fields.
"""

from __future__ import annotations

from kipp_core.server.chat_spec import ChatRequest, ChatSpec, Names, build_request, tool_choice
from kipp_core.server.context import ServingContext
from kipp_core.server.errors import bad_request
from kipp_core.server.protocol import (
    COMMON_FIELDS,
    Fields,
    check_model,
    sampling_fields,
    stream_flags,
)

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
    "thinking_token_budget",
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
    if raw is None or raw in ("none", "auto", "required"):
        return tool_choice(raw, tools)
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
    return tool_choice({"name": fn["name"]}, tools)


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


def parse_request(body: dict, ctx: ServingContext) -> ChatRequest:
    return build_request(chat_spec(body, ctx), ctx)


def chat_spec(body: dict, ctx: ServingContext) -> ChatSpec:
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
    return ChatSpec(
        messages,
        tools,
        choice,
        enable_thinking,
        f.integer("thinking_token_budget", lo=0),
        json_object,
        json_schema,
        max_tokens,
        sampling_fields(f, ctx.vocab_size),
        (top or 0) if logprobs else None,
        stream,
        include_usage,
        Names(max_tokens=max_param),
    )
