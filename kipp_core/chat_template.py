"""A checkpoint's chat template: one of the official Qwen3 ones, rendered natively (kipp_core.chat),
or any other, rendered by jinja2 the way transformers' apply_chat_template renders it.

The template comes from the checkpoint folder (chat_template.jinja, else tokenizer_config.json's
`chat_template`), compared with the known texts; a folder with none gets its registry entry's.
Each known template also says how its output carries reasoning:
- qwen3: `enable_thinking` switches it; the output opens `<think>` itself.
- qwen3-instruct-2507: never thinks; `enable_thinking` is ignored.
- qwen3-thinking-2507: always thinks; the prompt opens `<think>`, the output has only `</think>`.
Another template gets `enable_thinking` as a variable, and counts as opening the block when its
prompt ends with `<think>\\n`.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

from kipp_core.chat import GENERATION_PROMPTS, render

log = logging.getLogger("kipp")

FILES = {
    "qwen3": "chat_template.jinja",
    "qwen3-instruct-2507": "chat_template_instruct_2507.jinja",
    "qwen3-thinking-2507": "chat_template_thinking_2507.jinja",
}
THINKING = {"qwen3": "switch", "qwen3-instruct-2507": "never", "qwen3-thinking-2507": "always"}
THINK_OPENED = "<think>\n"  # a generation prompt ending so has opened the think block


def template_text(name: str) -> str:
    """The official template `name` (a key of FILES), verbatim."""
    return resources.files("kipp_core").joinpath("data", FILES[name]).read_text("utf-8")


@dataclass(frozen=True)
class ChatTemplate:
    """How a prompt is rendered and how its output's reasoning is read."""

    name: str  # a key of FILES, or "custom"
    source: str  # the template text
    special_tokens: tuple[tuple[str, str], ...] = ()  # bos_token etc. a custom template may read

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
    ) -> str:
        """The prompt text; ValueError on input the template cannot render."""
        if self.name in GENERATION_PROMPTS:
            return render(messages, tools, add_generation_prompt, enable_thinking, self.name)
        return _jinja_render(self, messages, tools, add_generation_prompt, enable_thinking)

    def thinking(self, enable_thinking: bool) -> bool:
        """Whether the output of a prompt rendered with `enable_thinking` holds reasoning."""
        mode = THINKING.get(self.name, "switch")
        return mode == "always" or (mode == "switch" and enable_thinking)


def opens_think(prompt: str) -> bool:
    """Whether the prompt's generation prompt opened the think block (Thinking-2507's does)."""
    return prompt.endswith(THINK_OPENED)


def read_template(model_dir: str | Path, tokenizer_config: dict) -> str | None:
    """A checkpoint folder's template text: chat_template.jinja (transformers 4.43 and later save
    it there, and it wins), else tokenizer_config.json's (a string, or a list of named templates:
    "default")."""
    path = Path(model_dir) / "chat_template.jinja"
    if path.is_file():
        return path.read_text("utf-8")
    t = tokenizer_config.get("chat_template")
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    return t if isinstance(t, str) else None


def chat_template_for(text: str | None, default: str = "qwen3", tokenizer_config=None, where=""):
    """The ChatTemplate for a checkpoint's template `text` (None: the template `default` names).
    A text that is no known one is rendered by jinja2, said once in the log."""
    if text is None:
        return ChatTemplate(default, template_text(default))
    for name in FILES:
        known = template_text(name)
        if text == known or text == known + "\n":  # trim_blocks drops a final newline
            return ChatTemplate(name, known)
    log.info(
        "the chat template of %s is none of the official Qwen3 ones: rendering it with jinja2",
        where or "this checkpoint",
    )
    specials = tuple(
        (k, v)
        for k, v in (tokenizer_config or {}).items()
        if k.endswith("_token") and isinstance(v, str)
    )
    _compile(text)  # a template that does not parse fails at load, not at the first request
    return ChatTemplate("custom", text, specials)


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    """The template compiled in the environment transformers uses (sandboxed, trim_blocks and
    lstrip_blocks, loopcontrols, its tojson, raise_exception and strftime_now)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None


def _jinja_render(t: ChatTemplate, messages, tools, add_generation_prompt, enable_thinking) -> str:
    import jinja2

    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    try:
        return _compile(t.source).render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            **dict(t.special_tokens),
        )
    except (jinja2.exceptions.TemplateError, TypeError, ValueError) as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from None
