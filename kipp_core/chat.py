# Native renderer for the official Qwen3 chat templates (kipp_core/data/chat_template*.jinja),
# plain Python so that serving needs no jinja. The 2507 templates are the Qwen3 one with another
# generation prompt (kipp_core/data/NOTICE).

from __future__ import annotations

import json

_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def _tojson(value: object, what: str) -> str:
    # transformers' `tojson` filter: no ASCII escaping, default separators, keys in given order
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serializable: {e}") from None


def _string(message: dict, key: str) -> str:
    # `message.x is string` in the template: None, lists, numbers and a missing key all give ''
    value = message.get(key)
    return value if isinstance(value, str) else ""


def _tool_call(call: object, where: str) -> str:
    # `if tool_call.function`: unwrap the OpenAI-style wrapper only when it is truthy
    if isinstance(call, dict) and call.get("function"):
        call = call["function"]
    # without a dict holding "arguments" the template fails on `Undefined | tojson`
    if not isinstance(call, dict) or "arguments" not in call:
        raise ValueError(f"{where} must be a dict with 'arguments' (optionally under 'function')")
    # jinja prints a non-string name with str() and a missing one as ''
    name = str(call["name"]) if "name" in call else ""
    args = call["arguments"]
    if not isinstance(args, str):
        args = _tojson(args, f"{where} arguments")
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + args + "}\n</tool_call>"


def _assistant(message: dict, where: str, keep_think: bool, last: bool) -> str:
    content = _string(message, "content")
    reasoning = message.get("reasoning_content")
    if not isinstance(reasoning, str):
        reasoning = ""
        if "</think>" in content:  # reasoning embedded in the content
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
    out = "<|im_start|>assistant\n"
    if keep_think and (last or reasoning):
        out += "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    else:
        out += content
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ValueError(f"{where} tool_calls must be a list")
        for j, call in enumerate(calls):
            # the newline test uses `content` before the lstrip above, as the template does
            if j or content:
                out += "\n"
            out += _tool_call(call, f"{where} tool_calls[{j}]")
    return out + "<|im_end|>\n"


def _validate(messages: object, tools: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be a dict with a string 'role'")
    # the template concatenates a leading system prompt, so anything but a string fails there
    if messages[0]["role"] == "system" and not isinstance(messages[0].get("content"), str):
        raise ValueError("messages[0] is a system message, its content must be a string")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("tools must be a list or None")


# What each template appends for add_generation_prompt: (always, and when enable_thinking is
# false). Qwen3's `is false` is an identity test, so 0 does not count.
GENERATION_PROMPTS = {
    "qwen3": ("<|im_start|>assistant\n", "<think>\n\n</think>\n\n"),
    "qwen3-instruct-2507": ("<|im_start|>assistant\n", ""),  # enable_thinking is ignored
    "qwen3-thinking-2507": ("<|im_start|>assistant\n<think>\n", ""),  # it opens the block
}


def render(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool = True,
    template: str = "qwen3",
) -> str:
    """Render `messages` into the prompt text, byte-identical to the official chat template named
    `template` (a key of GENERATION_PROMPTS).

    Messages are dicts with a string "role": "system", "user", "assistant" or "tool" (other roles
    are skipped, as the template skips them). Content that is not a string renders as ''.
    Assistant messages may carry "reasoning_content" and "tool_calls" (each a dict with "name" and
    "arguments", optionally wrapped as {"function": {...}}; non-string arguments are dumped as
    JSON). `tools` are JSON schemas listed in the system turn. With `enable_thinking=False` the
    Qwen3 template follows the generation prompt with an empty think block; the 2507 templates
    ignore it (Thinking-2507's generation prompt opens the think block itself). Raises ValueError
    on input the template cannot render (not a list, no role, a non-string leading system prompt,
    a malformed tool call, data that is not JSON-serializable).
    """
    _validate(messages, tools)
    if template not in GENERATION_PROMPTS:
        raise ValueError(f"unknown chat template {template!r}")
    n = len(messages)
    has_system = messages[0]["role"] == "system"
    out = []
    if tools:
        out.append("<|im_start|>system\n")
        if has_system:
            out.append(messages[0]["content"] + "\n\n")
        out.append(_TOOLS_HEAD)
        out.extend("\n" + _tojson(tool, f"tools[{i}]") for i, tool in enumerate(tools))
        out.append(_TOOLS_TAIL)
    elif has_system:
        out.append("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")

    # The last real user query; tool results sent back as user text do not count. Assistant turns
    # after it (a multi-step tool call) keep their reasoning.
    last_query = n - 1
    for i in range(n - 1, -1, -1):
        c = messages[i].get("content")
        if messages[i]["role"] == "user" and isinstance(c, str):
            if not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
                last_query = i
                break

    for i, m in enumerate(messages):
        role = m["role"]
        if role == "user" or (role == "system" and i > 0):
            out.append("<|im_start|>" + role + "\n" + _string(m, "content") + "<|im_end|>\n")
        elif role == "assistant":
            out.append(_assistant(m, f"messages[{i}]", i > last_query, i == n - 1))
        elif role == "tool":  # consecutive tool results share one user turn
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append("<|im_start|>user")
            out.append("\n<tool_response>\n" + _string(m, "content") + "\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                out.append("<|im_end|>\n")

    if add_generation_prompt:
        prompt, no_think = GENERATION_PROMPTS[template]
        out.append(prompt + (no_think if enable_thinking is False else ""))
    return "".join(out)
