"""Reading an Anthropic /v1/messages body into the ChatSpec all chat front ends share
(kipp_core/server/chat_spec.py).

`system` (a string or text blocks) is the system message; `messages` alternate user and assistant
turns of text, `tool_use` (an assistant's call, its `input` the arguments), `tool_result` (a tool
message each) and `thinking` blocks (the assistant's reasoning); a last assistant turn of text is
a prefill the answer continues. `tools` are custom tools (`input_schema`), `tool_choice` `auto`,
`any` (a call is forced), `tool` (that call) or `none`. `thinking`: `enabled` with
`budget_tokens` (any positive budget), `adaptive` or `between_tools` (thinking with the server's
budget, or `output_config.effort`'s), `disabled` or left out (Anthropic's default: no thinking;
an always-thinking checkpoint closes its thought at once). `output_config.format` holds the
answer to a JSON schema. The sampling fields older clients send (`temperature`, `top_p`, `top_k`)
are read; fields that change nothing here (`metadata`, `service_tier`, `cache_control`, ...) are
accepted.
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
from kipp_core.server.protocol import Fields, check_model

COMMON = ("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config")
FIELDS = (*COMMON, "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k")
IGNORED = (
    "metadata",
    "service_tier",
    "cache_control",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
    "diagnostics",
)
UNSUPPORTED = ("container", "mcp_servers", "context_management")
NAMES = Names(
    format="output_config.format",
    schema="output_config.format.schema",
    tool_schema="tools[{}].input_schema",
    budget="thinking.budget_tokens",
)


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or an array of content blocks")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad_request(f"{where}.content[{j}] must be a content block with a type")
    return content


def _text_of(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text must be a string")
    return block["text"]


def _tool_result(block: dict, where: str) -> dict:
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_request(f"{where}.tool_use_id must be a string")
    content = block.get("content", "")
    if not isinstance(content, str):
        parts = _blocks(content, where)
        for k, p in enumerate(parts):
            if p["type"] != "text":
                raise bad_request(f"{where}.content[{k}]: only text tool results are supported")
        content = "\n".join(_text_of(p, f"{where}.content[{k}]") for k, p in enumerate(parts))
    return {"role": "tool", "content": content, "tool_call_id": block["tool_use_id"]}


def _user(blocks: list[dict], where: str) -> list[dict]:
    out, texts = [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if b["type"] == "text":
            texts.append(_text_of(b, at))
        elif b["type"] == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(b, at))
        else:
            raise bad_request(
                f"{at}: a {b['type']!r} block is not supported (text and tool_result)"
            )
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(blocks: list[dict], where: str) -> dict:
    texts, calls, thoughts = [], [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if b["type"] == "text":
            texts.append(_text_of(b, at))
        elif b["type"] == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input"), dict):
                raise bad_request(f"{at}: a tool_use block needs a name and an input object")
            call = {"name": b["name"], "arguments": b["input"]}
            calls.append({"id": b.get("id"), "type": "function", "function": call})
        elif b["type"] == "thinking":
            if not isinstance(b.get("thinking"), str):
                raise bad_request(f"{at}.thinking must be a string")
            thoughts.append(b["thinking"])
        elif b["type"] != "redacted_thinking":  # (nothing to read in one)
            raise bad_request(f"{at}: a {b['type']!r} block is not supported in an assistant turn")
    msg = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning_content"] = "\n".join(thoughts)
    return msg


def parse_messages(f: Fields) -> tuple[list[dict], str | None]:
    """(the chat template's messages, the text of a last assistant turn to continue or None)."""
    system = f.raw("system")
    out = []
    if system is not None:
        blocks = _blocks(system, "system")
        if any(b["type"] != "text" for b in blocks):
            raise bad_request("system must be a string or an array of text blocks")
        out.append({"role": "system", "content": "\n".join(_text_of(b, "system") for b in blocks)})
    raw = f.raw("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages: at least one message is required")
    prefill = None
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be 'user' or 'assistant'")
        blocks = _blocks(m.get("content"), where)
        if m["role"] == "user":
            out += _user(blocks, where)
            continue
        msg = _assistant(blocks, where)
        if i == len(raw) - 1 and "tool_calls" not in msg:
            prefill = msg["content"]  # the answer continues this text
        else:
            out.append(msg)
    if prefill is not None and len(out) == (system is not None):
        raise bad_request("messages: an assistant prefill needs a user message before it")
    return out, prefill


def parse_tools(f: Fields) -> tuple[list[dict], str | dict]:
    """(OpenAI function tools, the normalized tool_choice)."""
    raw = f.array("tools", [])
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None):
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_request(f"tools[{i}]: only custom tools are supported, not {kind!r}")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string")
        if not isinstance(t.get("input_schema"), dict):
            raise bad_request(f"tools[{i}].input_schema must be an object")
        fn = {"name": t["name"]}  # in OpenAI's order, which the template's JSON keeps
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = t["input_schema"]
        tools.append({"type": "function", "function": fn})
    choice = f.mapping("tool_choice")
    if choice is None:
        return tools, tool_choice(None, tools)
    kind = choice.get("type")
    if kind == "tool" and isinstance(choice.get("name"), str):
        return tools, tool_choice({"name": choice["name"]}, tools)
    normal = {"auto": "auto", "any": "required", "none": "none"}.get(
        kind if isinstance(kind, str) else None
    )
    if normal is None:
        raise bad_request("tool_choice.type must be 'auto', 'any', 'tool' (with a name) or 'none'")
    return tools, tool_choice(normal, tools)


def parse_thinking(f: Fields) -> tuple[bool, int | None, bool]:
    """(thinking on, its budget or None, its display omitted)."""
    thinking = f.mapping("thinking", {"type": "disabled"})
    config = f.mapping("output_config", {})
    effort = config.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise bad_request("output_config.effort must be 'low', 'medium', 'high', 'xhigh' or 'max'")
    kind = thinking.get("type")
    omit = thinking.get("display") == "omitted"
    if kind == "disabled":
        return False, 0, False
    if kind in ("adaptive", "between_tools"):
        return True, EFFORT_BUDGETS.get(effort), omit
    if kind != "enabled":
        raise bad_request("thinking.type must be 'enabled', 'adaptive' or 'disabled'")
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise bad_request("thinking.budget_tokens must be a positive integer")
    return True, budget, omit


def _format(f: Fields) -> dict | None:
    fmt = f.mapping("output_config", {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise bad_request("output_config.format must be {'type': 'json_schema', 'schema': {...}}")
    if not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format.schema must be an object")
    return fmt["schema"]


def _sampling(f: Fields) -> dict:
    kw = {"temperature": f.number("temperature", lo=0.0, hi=1.0), "top_p": f.number("top_p")}
    kw["top_k"] = f.integer("top_k", lo=0)
    stop = f.array("stop_sequences")
    if stop is not None and not all(isinstance(s, str) and s for s in stop):
        raise bad_request("stop_sequences must be an array of non-empty strings")
    kw["stop"] = stop
    return {k: v for k, v in kw.items() if v is not None}


def _spec(body: dict, ctx: ServingContext, generate: bool) -> ChatSpec:
    f = Fields(body, (FIELDS if generate else COMMON) + UNSUPPORTED, IGNORED)
    for name in UNSUPPORTED:
        if f.has(name):
            raise bad_request(f"{name} is not supported")
    check_model(f, (ctx.model_name,))
    messages, prefill = parse_messages(f)
    tools, choice = parse_tools(f)
    thinking, budget, omit = parse_thinking(f)
    schema = _format(f)
    spec = ChatSpec(messages, tools, choice, thinking, budget, schema is not None, schema)
    spec.names, spec.prefill, spec.include_reasoning = NAMES, prefill, not omit
    if generate:
        spec.max_tokens = f.integer("max_tokens", lo=1)
        if spec.max_tokens is None:
            raise bad_request("max_tokens: Field required")
        spec.sampling = _sampling(f)
        spec.stream = f.boolean("stream", False)
    return spec


def parse_request(body: dict, ctx: ServingContext) -> ChatRequest:
    return build_request(_spec(body, ctx, True), ctx)


def count_request(body: dict, ctx: ServingContext) -> ChatRequest:
    """A /v1/messages/count_tokens body (no max_tokens, no sampling) as the request it counts."""
    return build_request(_spec(body, ctx, False), ctx)
