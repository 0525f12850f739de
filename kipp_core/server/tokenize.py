"""POST /tokenize and /detokenize in vLLM's shapes, so that a client (lm-eval, a UI) finds the
server's tokenizer from the server alone.

/tokenize takes a text as `prompt` (vLLM) or `content` (llama-server), or chat `messages` (with
`tools`, `add_generation_prompt` and `chat_template_kwargs`, rendered as /v1/chat/completions
renders them), and answers `{"count", "max_model_len", "tokens", "token_strs"}` (the pieces when
`return_token_strs`, else null). /detokenize takes `tokens` and answers `{"prompt"}`. Qwen3 adds no
special tokens to a text, so `add_special_tokens` (accepted) changes nothing.
"""

from __future__ import annotations

from aiohttp import web

from kipp_core.chat import render
from kipp_core.server.chat_request import parse_messages, parse_thinking, parse_tools
from kipp_core.server.context import STATE
from kipp_core.server.errors import bad_request
from kipp_core.server.protocol import Fields, check_model, parse_json, token_id_list
from kipp_core.server.streaming import dumps

TEXT_FIELDS = ("model", "prompt", "content", "add_special_tokens", "return_token_strs")
CHAT_FIELDS = (
    "model",
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "return_token_strs",
    "chat_template_kwargs",
)


def _json(body: dict) -> web.Response:
    return web.Response(body=dumps(body), content_type="application/json")


def _ids(body: dict, ctx) -> tuple[list[int], Fields]:
    chat = "messages" in body
    f = Fields(body, CHAT_FIELDS if chat else TEXT_FIELDS)
    check_model(f, (ctx.model_name,))
    f.boolean("add_special_tokens")
    if not chat:
        name = "content" if f.has("content") and not f.has("prompt") else "prompt"
        text = f.string(name)
        if text is None:
            raise bad_request("prompt (or content, or messages) is required", "prompt")
        return ctx.tokenizer.encode(text), f
    if f.boolean("continue_final_message", False):
        raise bad_request("continue_final_message is not supported", "continue_final_message")
    tools = parse_tools(f.raw("tools")) or None
    thinking = parse_thinking(f)
    add = f.boolean("add_generation_prompt", True)
    try:
        prompt = render(parse_messages(f.raw("messages")), tools, add, thinking)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    return ctx.tokenizer.encode(prompt), f


async def tokenize(request: web.Request) -> web.Response:
    ctx = request.app[STATE].ready()
    ids, f = _ids(parse_json(await request.read()), ctx)
    strs = None
    if f.boolean("return_token_strs", False):
        strs = [ctx.tokenizer.token_str(i) for i in ids]
    return _json(
        {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: web.Request) -> web.Response:
    ctx = request.app[STATE].ready()
    f = Fields(parse_json(await request.read()), ("model", "tokens"))
    check_model(f, (ctx.model_name,))
    ids = token_id_list(f, "tokens", ctx.vocab_size)
    if ids is None:
        raise bad_request("tokens is required", "tokens")
    return _json({"prompt": ctx.tokenizer.decode(ids)})
