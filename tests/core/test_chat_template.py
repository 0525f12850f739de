"""Which template a checkpoint renders with: the official ones (the 2507 texts as QWEN3-2507.md
quotes them) natively, anything else through jinja2 equal to transformers' apply_chat_template,
said once in the log; chat_template.jinja wins over tokenizer_config.json, as in transformers."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil

import pytest

from kipp_core.chat_template import chat_template_for, opens_think, read_template
from kipp_core.llm import LLM
from kipp_core.vocab import chat_template

# (bytes, sha256) of the templates decoded from the repos' tokenizer_config.json (QWEN3-2507.md
# sections 1.4 and 2.4: 4,040 and 4,049 characters)
OFFICIAL = {
    "qwen3-instruct-2507": (
        4040,
        "40c21f34cf67d8c760ef72f8ad3ae5afad514299d4b06e91dd9a8d705af7b541",
    ),
    "qwen3-thinking-2507": (
        4049,
        "3802169b2a02b81e6adb7ab4f64f91ff02db753c8c3a64a01c35192d3a61d8d7",
    ),
}
# Qwen3's generation prompt (QWEN3-2507.md section 3, its last lines) and the 2507 ones
QWEN3_TAIL = (
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)
TAILS_2507 = {
    "qwen3-instruct-2507": "    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}",
    "qwen3-thinking-2507": "    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}",
}
# A fine-tune's own template: chatml with the eos token, tojson, raise_exception and a switch
CUSTOM = (
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unsupported role ' + m.role) }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + eos_token + '\\n' }}"
    "{%- endfor %}"
    "{%- if tools %}{{- tools | tojson }}{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


@pytest.mark.parametrize("name", list(OFFICIAL))
def test_2507_templates_are_the_official_ones(name):
    text = chat_template(name)
    assert (len(text.encode()), hashlib.sha256(text.encode()).hexdigest()) == OFFICIAL[name]
    # and differ from Qwen3's only in the generation prompt
    assert chat_template("qwen3").endswith(QWEN3_TAIL)
    assert text == chat_template("qwen3")[: -len(QWEN3_TAIL)] + TAILS_2507[name]


def test_known_texts_render_natively(caplog):
    with caplog.at_level(logging.INFO, logger="kipp"):
        for name in ("qwen3", *OFFICIAL):
            assert chat_template_for(chat_template(name)).name == name
            assert chat_template_for(chat_template(name) + "\n").name == name
        assert chat_template_for(None, "qwen3-thinking-2507").name == "qwen3-thinking-2507"
    assert "jinja2" not in caplog.text
    t = chat_template_for(chat_template("qwen3-thinking-2507"))
    msgs = [{"role": "user", "content": "Hi"}]  # QWEN3-2507.md section 2.4's rendered example
    assert t.render(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert opens_think(t.render(msgs)) and t.thinking(False)
    i = chat_template_for(chat_template("qwen3-instruct-2507"))
    assert i.render(msgs, enable_thinking=False) == i.render(msgs) and not i.thinking(True)


@pytest.fixture
def custom_dir(tiny_path, tmp_path):
    d = tmp_path / "finetune"
    shutil.copytree(tiny_path, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CUSTOM}))
    return d


CASES = [
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é"}], None),
    ([{"role": "user", "content": "weather?"}], [{"type": "function", "function": {"name": "w"}}]),
]


def test_other_template_renders_through_jinja2_as_transformers(custom_dir, caplog):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(custom_dir))
    with caplog.at_level(logging.INFO, logger="kipp"):
        llm = LLM(str(custom_dir))
    assert caplog.text.count("none of the official Qwen3 ones") == 1
    t = llm.chat_template
    assert t.name == "custom"
    for messages, tools in CASES:
        for gen in (True, False):
            for think in (True, False):
                want = ref.apply_chat_template(
                    messages,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=gen,
                    enable_thinking=think,
                )
                assert t.render(messages, tools, gen, think) == want
    assert t.thinking(True) and not t.thinking(False)
    with pytest.raises(ValueError, match="unsupported role tool"):
        t.render([{"role": "tool", "content": "x"}])


def test_chat_template_jinja_file_wins(custom_dir):
    (custom_dir / "chat_template.jinja").write_text(chat_template("qwen3-instruct-2507"))
    cfg = json.loads((custom_dir / "tokenizer_config.json").read_text())
    assert read_template(custom_dir, cfg) == chat_template("qwen3-instruct-2507")
    assert LLM(str(custom_dir)).chat_template.name == "qwen3-instruct-2507"
    named = {
        "chat_template": [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": CUSTOM},
        ]
    }
    assert read_template(custom_dir / "nowhere", named) == CUSTOM


def test_a_template_that_does_not_compile_fails_at_load():
    with pytest.raises(ValueError, match="the chat template does not compile"):
        chat_template_for("{% if %}")


def test_random_2507_checkpoints_carry_their_template(tmp_path):
    from kipp_core.registry import lookup
    from kipp_core.tiny import write_tokenizer

    for name in OFFICIAL:
        write_tokenizer(
            tmp_path, template=lookup(name.replace("qwen3-", "qwen3-4b-")).chat_template
        )
        cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
        assert cfg["chat_template"] == chat_template(name)
