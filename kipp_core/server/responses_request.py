"""Reading an OpenAI /v1/responses body into the ChatSpec all chat front ends share
(kipp_core/server/chat_spec.py), without stored state.

`input` is a string (one user message) or items: messages (roles `user`, `system`, `developer`,
`assistant`; content a string or `input_text` / `output_text` parts), `function_call` (an
assistant's call), `function_call_output` (a tool message) and `reasoning` (the next assistant
message's reasoning). `instructions` is the system message. `tools` are function tools,
`tool_choice` `auto`, `none`, `required` or `{"type": "function", "name": ...}`. `text.format`
is `text`, `json_object` or `json_schema`; `reasoning.effort` maps to a thinking budget
(chat_spec.EFFORT_BUDGETS: `none` thinks not at all), and without it the model thinks as its chat
template says, with the server's budget. `previous_response_id`, `store: true`, `background`,
`conversation` and stored `prompt`s need state the server does not keep: a 400 that says so.
"""

from __future__ import annotations

from kipp_core.server.chat_spec import (
    EFFORT_BUDGETS,
    ChatRequest,
    ChatSpec,
    Names,
    build_request,
    tool_choice,
)
from kipp_core.server.context import ServingContext
from kipp_core.server.errors import bad_request
from kipp_core.server.protocol import Fields, check_model, stream_flags

FIELDS = (
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "reasoning",
    "stream",
    "stream_options",
    "store",
    "parallel_tool_calls",
    "metadata",
    "user",
    "truncation",
    "include",
    "top_logprobs",
)
# Fields with no effect here, accepted so that clients setting them keep working.
IGNORED = (
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",
    "max_tool_calls",
    "access_programs",
    "moderation",
    "context_management",
    "background_options",
)
STATEFUL = ("previous_response_id", "conversation", "prompt", "background")
UNSUPPORTED = ("image",)
NAMES = Names(
    messages="input",
    max_tokens="max_output_tokens",
    format="text.format",
    schema="text.format.schema",
    tool_schema="tools[{}].parameters",
)
# what a response object repeats of its request
ECHO = ("instructions", "metadata", "parallel_tool_calls", "reasoning", "text", "tool_choice")
ECHO += ("tools", "truncation", "user")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
NO_STATE = "the server keeps no responses: send the whole conversation in `input`"


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise bad_request(f"{where}.content[{j}]: only text parts are supported", "input")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.content[{j}].text must be a string", "input")
        texts.append(text)
    return "\n".join(texts)


def _reasoning(item: dict, where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary's text."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise bad_request(f"{where}.content must be an array of parts", "input")
    texts = []
    for j, part in enumerate(parts):
        text = part.get("text") if isinstance(part, dict) else None
        if not isinstance(text, str) or part.get("type") not in ("reasoning_text", "summary_text"):
            raise bad_request(f"{where}.content[{j}] must be a reasoning_text part", "input")
        texts.append(text)
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad_request(f"{where}.{key} must be a string", "input")
    return v


def parse_input(f: Fields) -> list[dict]:
    """The chat template's messages of `instructions` and `input`."""
    out = []
    instructions = f.string("instructions")
    if instructions is not None:
        out.append({"role": "system", "content": instructions})
    raw = f.raw("input")
    if isinstance(raw, str):
        return [*out, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must be a string or a non-empty array of items", "input")
    reasoning = None  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind == "message":
            role = item.get("role")
            role = ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}", "input")
            out.append({"role": role, "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            if last is None or reasoning is not None:
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _content(output, f"{where}.output")
            call_id = _string(item, "call_id", where)
            out.append({"role": "tool", "content": text, "tool_call_id": call_id})
        elif kind == "reasoning":
            reasoning = _reasoning(item, where)
            continue
        elif kind == "item_reference":
            raise bad_request(f"{where}: item_reference needs stored items; {NO_STATE}", "input")
        else:
            raise bad_request(f"{where}: items of type {kind!r} are not supported", "input")
        if reasoning is not None and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = reasoning
        reasoning = None
    return out


def parse_tools(f: Fields) -> tuple[list[dict], str | dict]:
    """(OpenAI chat function tools, the normalized tool_choice)."""
    tools = []
    for i, t in enumerate(f.array("tools", [])):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(
                f"tools[{i}]: only function tools are supported, not {kind!r}", "tools"
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string", "tools")
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].parameters must be an object", "tools")
        fn = {"name": t["name"]}  # in OpenAI's order, which the template's JSON keeps
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = params
        tools.append({"type": "function", "function": fn})
    raw = f.raw("tool_choice")
    if raw is None or raw in ("none", "auto", "required"):
        return tools, tool_choice(raw, tools)
    if isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str):
        return tools, tool_choice({"name": raw["name"]}, tools)
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        "tool_choice",
    )


def _format(f: Fields) -> tuple[bool, dict | bool | None]:
    text = f.mapping("text", {})
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str):
            raise bad_request("text.format.name must be a string", "text.format")
        schema = fmt.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad_request("text.format.schema must be an object", "text.format")
        return True, schema
    raise bad_request("text.format.type must be 'text', 'json_object' or 'json_schema'", "text")


def _thinking(f: Fields) -> tuple[bool, int | None]:
    effort = f.mapping("reasoning", {}).get("effort")
    if effort is None:
        return True, None
    if not isinstance(effort, str) or effort not in EFFORT_BUDGETS:
        raise bad_request(
            f"reasoning.effort must be one of {', '.join(EFFORT_BUDGETS)}", "reasoning.effort"
        )
    budget = EFFORT_BUDGETS[effort]
    return budget != 0, budget


def parse_request(body: dict, ctx: ServingContext) -> ChatRequest:
    f = Fields(body, FIELDS + STATEFUL + UNSUPPORTED, IGNORED)
    for name in STATEFUL:
        if f.has(name) and body[name] is not False:
            raise bad_request(f"{name} is not supported: {NO_STATE}", name)
    if f.boolean("store", False):
        raise bad_request(f"store must be false: {NO_STATE}", "store")
    for name in UNSUPPORTED:
        if f.has(name):
            raise bad_request(f"{name} is not supported", name)
    check_model(f, (ctx.model_name,))
    stream, _ = stream_flags(f)
    for name in ("user", "truncation"):
        f.string(name)
    f.boolean("parallel_tool_calls")
    f.mapping("metadata")
    f.array("include")
    f.integer("top_logprobs", lo=0, hi=20)
    messages = parse_input(f)
    tools, choice = parse_tools(f)
    thinking, budget = _thinking(f)
    json_object, schema = _format(f)
    sampling = {"temperature": f.number("temperature", lo=0.0, hi=2.0), "top_p": f.number("top_p")}
    spec = ChatSpec(
        messages,
        tools,
        choice,
        thinking,
        budget,
        json_object,
        schema,
        f.integer("max_output_tokens", lo=1),
        {k: v for k, v in sampling.items() if v is not None},
        stream=stream,
        names=NAMES,
    )
    req = build_request(spec, ctx)
    req.echo = {k: body.get(k) for k in ECHO}
    req.echo["temperature"] = req.params.temperature
    req.echo["top_p"] = req.params.top_p
    req.echo["max_output_tokens"] = req.params.max_tokens
    return req
