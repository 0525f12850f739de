"""The thinking budget on the oracle: where a thought opens (the prompt, or an output that starts
with <think>), that the N tokens after <think> are the model's own and the next three are
`\\n</think>\\n\\n`, that a thought the model closes itself is left alone, that a sequence under
speculation proposes no drafts past its budget, and the parameter's bounds. The reference is the
same request without a budget (seeded: the noise is a function of the step, so the tokens agree up
to the budget) and the closing sequence as the tokenizer encodes it."""

from __future__ import annotations

import pytest

from kipp_core.llm import LLM
from kipp_core.sampling import SamplingParams
from kipp_core.thinking_budget import CLOSING, ThinkTokens, Thought

OPENED = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
PLAIN = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(str(tiny_path), backend="oracle")


@pytest.fixture(scope="module")
def tokens(llm):
    return ThinkTokens(llm.tokenizer, llm.engine.model_config.vocab_size)


def _ids(llm, prompt, **kw):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=14, ignore_eos=True, **kw)
    return llm.generate([llm.tokenizer.encode(prompt)], params)[0].token_ids


@pytest.mark.parametrize("budget", [0, 1, 5])
def test_an_opened_thought_is_closed_after_its_budget(llm, budget):
    free = _ids(llm, OPENED)
    got = _ids(llm, OPENED, thinking_token_budget=budget)
    closing = llm.tokenizer.encode(CLOSING)
    assert len(closing) == 3
    assert got[:budget] == free[:budget]
    assert got[budget : budget + 3] == closing
    assert free[budget : budget + 3] != closing  # (the model would not have written it)


def test_a_thought_the_output_opens_counts_after_its_open_tag(llm, tokens):
    """<think> biased to be every free token: the thought opens at the first one, and the three
    forced tokens come after 4 more of it."""
    bias = {tokens.open_id: 100}
    got = _ids(llm, PLAIN, thinking_token_budget=4, logit_bias=bias)
    assert got[:5] == [tokens.open_id] * 5
    assert got[5:8] == list(tokens.closing)
    assert got[8:] == [tokens.open_id] * (len(got) - 8)  # the answer is the model's again


def test_no_thought_no_forcing(llm, tokens):
    """An output that does not start with <think> has no thought: nothing is forced."""
    assert _ids(llm, PLAIN, thinking_token_budget=0) == _ids(llm, PLAIN)


def test_a_thought_closed_by_the_model_is_left_alone(llm, tokens):
    bias = {tokens.close_id: 100}
    got = _ids(llm, OPENED, thinking_token_budget=3, logit_bias=bias)
    assert got == [tokens.close_id] * 14


def test_each_child_has_its_own_budget(llm, tokens):
    ids = llm.tokenizer.encode(OPENED)
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=9, thinking_token_budget=2)
    out = llm.generate([ids], params)[0]
    for c in out.outputs:
        assert c.token_ids[2:5] == list(tokens.closing)


def test_speculation_drafts_stop_at_the_budget(tiny_path, tokens):
    """A thought of <think> repeated (biased) is what ngram drafts guess right: without the
    budget's room they would be accepted past it. The closing still comes right after it."""
    spec = LLM(str(tiny_path), backend="oracle", speculative="ngram", num_speculative_tokens=4)
    params = SamplingParams(
        temperature=0,
        max_tokens=20,
        ignore_eos=True,
        thinking_token_budget=8,
        logit_bias={tokens.open_id: 100},
    )
    got = spec.generate([spec.tokenizer.encode(PLAIN)], params)[0].token_ids
    assert got[:9] == [tokens.open_id] * 9 and got[9:12] == list(tokens.closing)
    assert got[12:] == [tokens.open_id] * 8
    assert spec.engine.spec.accepted > 0, "speculation never had a draft accepted"


def test_thought_states_by_hand(tokens):
    t = Thought(tokens, 2, [1, 2, tokens.open_id])
    assert t.forced([]) is None and t.may_force([], 1) is False
    assert t.may_force([], 2)  # the second pending token may be the last of the budget
    assert t.forced([5, 6]) == tokens.closing[0]
    assert t.room([5, 6]) == 0
    assert t.forced([5, 6, *tokens.closing[:2]]) == tokens.closing[2]
    assert t.forced([5, 6, *tokens.closing]) is None and t.done
    undecided = Thought(tokens, 0, [1, 2])
    assert undecided.may_force([], 1)  # the pending first token may be <think>
    assert not undecided.may_force([9], 1) and undecided.done


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_budget_must_be_a_non_negative_integer(bad):
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=bad)
