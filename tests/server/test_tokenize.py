"""/tokenize and /detokenize over raw HTTP in the shapes vLLM documents (and llama-server's
`content`), against the transformers tokenizer and chat template of the same checkpoint."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.server.conftest import assert_error_body

TEXT = "Hello world, héllo 🌍\n  code"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def hf(tiny_path):
    return AutoTokenizer.from_pretrained(str(tiny_path))


@pytest.mark.parametrize("field", ["prompt", "content"])
def test_tokenize_a_text(http, hf, field):
    status, _, body = http.post("/tokenize", {"model": "kipp-tiny", field: TEXT})
    want = hf(TEXT, add_special_tokens=True)["input_ids"]
    assert status == 200 and body == {
        "count": len(want),
        "max_model_len": 4096,
        "tokens": want,
        "token_strs": None,
    }
    _, _, body = http.post("/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert body["token_strs"] == hf.convert_ids_to_tokens(want)


def template_ids(hf, add: bool, thinking: bool) -> list[int]:
    out = hf.apply_chat_template(
        MESSAGES, tokenize=True, return_dict=True, add_generation_prompt=add,
        enable_thinking=thinking,
    )  # fmt: skip
    return list(out["input_ids"])


@pytest.mark.parametrize("thinking", [True, False])
def test_tokenize_chat_messages_as_the_official_template(http, hf, thinking):
    body = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": thinking}}
    status, _, got = http.post("/tokenize", body)
    want = template_ids(hf, True, thinking)
    assert status == 200 and got["tokens"] == want and got["count"] == len(want)
    _, _, bare = http.post("/tokenize", {**body, "add_generation_prompt": False})
    assert bare["tokens"] == template_ids(hf, False, thinking)


def test_detokenize_gives_the_text_back(http, hf):
    ids = hf(TEXT)["input_ids"]
    status, _, body = http.post("/detokenize", {"model": "kipp-tiny", "tokens": ids})
    assert status == 200 and body == {"prompt": hf.decode(ids)} and body["prompt"] == TEXT


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(http, path, body, param):
    status, _, got = http.post(path, body)
    assert status in (400, 404) and assert_error_body(got)["param"] == param
