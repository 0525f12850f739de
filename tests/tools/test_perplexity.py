"""`kipp ppl` against transformers: the strided-window perplexity of the transformers guide
"Perplexity of fixed-length models", computed here by its own loop over Qwen3ForCausalLM."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from kipp_core.cli.main import main
from kipp_core.perplexity import Window, windows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# A wikitext-2 raw style snippet: " = Title = " headings, blank lines, spaces before punctuation.
TEXT = (
    " \n = Robert Boulter = \n \n Robert Boulter is an English film , television and theatre "
    "actor . He had a guest @-@ starring role on the television series The Bill in 2000 . This "
    "was followed by a starring role in the play Herons written by Simon Stephens , which was "
    "performed in 2001 at the Royal Court Theatre . \n \n = = Career = = \n \n In 2006 , Boulter "
    "starred alongside Whishaw in the play Citizenship written by Mark Ravenhill . He appeared "
    "on a 2006 episode of the television series , Doctors , followed by a role in the 2007 "
    "theatre production of How to Curse directed by Josie Rourke . \n"
)
CTX, STRIDE = 64, 32


def test_windows_follow_the_transformers_loop():
    # Derived by hand from the guide's loop (labels shift, so a window never scores its first).
    assert windows(10, 4, 2) == [
        Window(0, 4, 1),
        Window(2, 6, 4),
        Window(4, 8, 6),
        Window(6, 10, 8),
    ]
    assert windows(10, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]
    assert windows(3, 8, 4) == [Window(0, 3, 1)]
    for n, c, s in [(100, 16, 5), (37, 8, 7), (64, 64, 1)]:
        assert sum(w.end - w.first_scored for w in windows(n, c, s)) == n - 1
    # stride == ctx: every window starts without context, so its first token is not scored
    assert sum(w.end - w.first_scored for w in windows(37, 8, 8)) == 37 - 5
    for bad in [(10, 1, 1), (10, 4, 0), (10, 4, 5), (1, 4, 2)]:
        with pytest.raises(ValueError):
            windows(*bad)


def transformers_perplexity(path, text: str, ctx: int, stride: int) -> tuple[float, list[int]]:
    """The guide's loop in float32. Each window's mean loss is weighted by the number of labels
    it really averaged; the guide's code subtracts one label per window even when the shifted-out
    first label is already masked, which misweights every window after the first."""
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    input_ids = tok(text, return_tensors="pt").input_ids
    seq_len = input_ids.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + ctx, seq_len)
        trg_len = end_loc - prev_end_loc
        ids = input_ids[:, begin_loc:end_loc]
        target_ids = ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(ids, labels=target_ids).loss
        num_valid = (target_ids[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * num_valid
        n_tokens += num_valid
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return math.exp(nll_sum / n_tokens), input_ids[0].tolist()


@pytest.fixture(scope="module")
def reference(tiny_path):
    return transformers_perplexity(tiny_path, TEXT, CTX, STRIDE)


def test_kipp_ppl_equals_transformers_on_the_oracle(tmp_path, tiny_path, reference, capsys):
    f = tmp_path / "wiki.test.raw"
    f.write_text(TEXT, encoding="utf-8")
    argv = ["ppl", "--model", str(tiny_path), "--backend", "oracle", "--file", str(f)]
    assert main([*argv, "--ctx", str(CTX), "--stride", str(STRIDE), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ref_ppl, ref_ids = reference
    assert out["num_tokens"] == len(ref_ids)
    assert out["num_scored"] == len(ref_ids) - 1
    assert out["tokens_per_second"] > 0
    assert abs(out["perplexity"] - ref_ppl) <= 1e-4 * ref_ppl


def _backend_available(name: str) -> bool:
    # Without a GPU the cuda backend runs its torch references: still the same gate.
    return importlib.util.find_spec(f"kipp_{name}.backend") is not None


@pytest.mark.parametrize("backend", ["cuda", "mlx"])
def test_backend_ppl_equals_transformers(backend, tiny_path, reference):
    if not _backend_available(backend):
        pytest.skip(f"the {backend} backend is not available here")
    from kipp_core.llm import LLM
    from kipp_core.perplexity import perplexity

    llm = LLM(str(tiny_path), backend=backend, dtype="float32")
    ref_ppl, ref_ids = reference
    r = perplexity(llm, llm.tokenizer.encode(TEXT), CTX, STRIDE)
    assert abs(r.perplexity - ref_ppl) <= 1e-4 * ref_ppl


@pytest.mark.parametrize(
    ("text", "args", "says"),
    [
        ("", [], "--file"),  # no tokens
        ("   \n", [], "--file"),
        ("hello world " * 20, ["--ctx", "8192"], "--ctx"),  # kipp-tiny holds 4,096
    ],
)
def test_what_kipp_ppl_rejects_it_rejects_before_loading(
    tmp_path, text, args, says, monkeypatch, capsys
):
    from kipp_core.cli import ppl

    def no_load(*a, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(ppl, "load_llm", no_load)
    f = tmp_path / "t.txt"
    f.write_text(text)
    assert main(["ppl", "--file", str(f), "--backend", "oracle", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"kipp ppl: error: argument {says}"), err
