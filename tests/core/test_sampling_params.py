"""SamplingParams: defaults, normalization, and ValueErrors that name the field."""

import dataclasses

import numpy as np
import pytest

from kipp_core import sampling as S
from kipp_core.sampling import SamplingParams

# --- SamplingParams -------------------------------------------------------------------------------


def test_defaults_and_normalization():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens) == (1, 1.0, 1.0, 0, 16)
    assert p.stop == [] and p.stop_strings == [] and p.stop_token_ids == []
    assert SamplingParams(stop="###").stop_strings == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(logit_bias={"12": 5, 3: -1.5}).logit_bias == {12: 5.0, 3: -1.5}
    assert SamplingParams(temperature=1).temperature == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(seed=2**80 + 1).seed == 2**80 + 1
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None
    assert SamplingParams(n=np.int64(3)).n == 3
    assert SamplingParams(logprobs=0, prompt_logprobs=20).logprobs == 0


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams().is_greedy


def test_replace_revalidates_and_params_are_frozen():
    p = SamplingParams(temperature=0.5)
    assert p.replace(top_p=0.5).top_p == 0.5 and p.top_p == 1.0
    with pytest.raises(ValueError, match="top_p"):
        p.replace(top_p=1.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 2.0


def test_error_message_format():
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=-1.0)
    assert str(e.value) == "temperature must be >= 0, got -1.0"


BAD = [
    ("n", 0),
    ("n", 129),
    ("n", 1.5),
    ("n", True),
    ("n", "2"),
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("temperature", None),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", float("nan")),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", True),
    ("top_k", "5"),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    # float32 is what the samplers compute in: these round to inf, 0 or a subnormal there
    ("temperature", 1e39),
    ("temperature", 1e308),
    ("repetition_penalty", 1e-300),
    ("repetition_penalty", 1e-40),
    ("repetition_penalty", 1e39),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", -3),
    ("frequency_penalty", 2.1),
    ("seed", 1.5),
    ("seed", "7"),
    ("seed", True),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 0.5),
    ("logprobs", 21),
    ("logprobs", -1),
    ("logprobs", 1.0),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", -1),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", 1),
    ("include_stop_str_in_output", None),
]


@pytest.mark.parametrize("name,value", BAD)
def test_invalid_scalar_values(name, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{name: value})
    assert name in str(e.value) and repr(value) in str(e.value)


@pytest.mark.parametrize(
    "kw,fragment",
    [
        ({"logit_bias": {"abc": 1.0}}, "'abc'"),
        ({"logit_bias": {-1: 1.0}}, "-1"),
        ({"logit_bias": {"-1": 1.0}}, "'-1'"),
        ({"logit_bias": {"\uff11": 1.0}}, "'\uff11'"),  # a fullwidth digit
        ({"logit_bias": {5: 100.5}}, "100.5"),
        ({"logit_bias": {5: "x"}}, "'x'"),
        ({"logit_bias": [1, 2]}, "[1, 2]"),
        ({"stop": ""}, "''"),
        ({"stop": ["a", ""]}, "''"),
        ({"stop": ["a", 3]}, "3"),
        ({"stop": 5}, "5"),
        ({"stop": ["s"] * 17}, "['s'"),
        ({"stop_token_ids": [-1]}, "-1"),
        ({"stop_token_ids": ["3"]}, "'3'"),
        ({"stop_token_ids": [True]}, "True"),
        ({"stop_token_ids": 7}, "7"),
        ({"min_tokens": 5, "max_tokens": 4}, "5"),
    ],
)
def test_invalid_container_values(kw, fragment):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    name = next(iter(kw))
    assert name in str(e.value) and fragment in str(e.value)


def test_stop_token_set():
    p = SamplingParams(stop_token_ids=[7, 2])
    assert S.stop_token_set(p, (2, 9)) == (2, 9, 7)
    assert S.stop_token_set(p.replace(ignore_eos=True), (2, 9)) == (7, 2)


def test_resolve_seed():
    assert S.resolve_seed(SamplingParams(seed=5)) == 5
    a, b = S.resolve_seed(SamplingParams()), S.resolve_seed(SamplingParams())
    assert 0 <= a < 2**64 and a != b


def test_float32_bounds_are_the_edges_of_float32():
    """The largest float32 (3.4028235e38) and the smallest normal one (2**-126) are accepted."""
    assert SamplingParams(temperature=3.4028234e38).temperature == 3.4028234e38
    assert SamplingParams(repetition_penalty=3.4028234e38).repetition_penalty == 3.4028234e38
    assert SamplingParams(repetition_penalty=2.0**-126).repetition_penalty == 2.0**-126
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=2.0**-127)
