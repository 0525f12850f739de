import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kipp_core.stop import StopMatcher


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Non-streaming cut: the earliest occurrence wins, the longest stop at the same start."""
    hits = [(text.find(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    i, _, s = min(hits)
    return (text[: i + len(s)] if include else text[:i]), s


def decided(prefix: str, stops: list[str], include: bool) -> bool:
    """Whether `prefix` already fixes the cut: a stop occurs in it, and no stop that starts
    earlier (or, when the stop string is emitted, at the same place) could still complete."""
    _, hit = reference(prefix, stops, include)
    if hit is None:
        return False
    i = prefix.find(hit)
    for s in stops:
        for j in range(max(0, len(prefix) - len(s) + 1), len(prefix)):
            if (j < i or (include and j == i)) and s.startswith(prefix[j:]):
                return False
    return True


def safe_len(prefix: str, stops: list[str]) -> int:
    """Length of the prefix before the first place a stop starts or may start."""
    starts = [prefix.find(s) for s in stops if s in prefix]
    starts += [
        j
        for s in stops
        for j in range(max(0, len(prefix) - len(s) + 1), len(prefix))
        if s.startswith(prefix[j:])
    ]
    return min(starts, default=len(prefix))


def run(stops, deltas, include=False):
    m = StopMatcher(stops, include_stop=include)
    outs = [m.feed(d) for d in deltas]
    return m, outs, m.flush()


# --- hand-worked cases ----------------------------------------------------------------------------


def test_stop_spanning_tokens_is_never_emitted():
    m, outs, tail = run(["</s>"], ["Hello <", "/", "s> world"])
    assert outs == [("Hello ", False), ("", False), ("", True)]
    assert tail == "" and m.text == "Hello " and m.matched == "</s>"


def test_held_back_prefix_is_released_when_it_cannot_match():
    m = StopMatcher(["abc"])
    assert m.feed("xab") == ("x", False)
    assert m.feed("x") == ("abx", False)
    assert m.feed("ab") == ("", False)
    assert m.flush() == "ab"
    assert m.text == "xabxab" and not m.stopped and m.matched is None


def test_earlier_partial_stop_wins_over_later_complete_one():
    # "bc" is complete at index 1, but "abcd" could still start at 0.
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("abc") == ("", False)
    assert m.feed("d") == ("", True)
    assert m.matched == "abcd"

    m = StopMatcher(["abcd", "bc"])
    assert m.feed("abc") == ("", False)
    assert m.feed("x") == ("a", True)
    assert m.matched == "bc"


def test_flush_resolves_a_pending_complete_stop():
    m = StopMatcher(["abcd", "bc"])
    assert m.feed("zabc") == ("z", False)
    assert m.flush() == "a"
    assert m.stopped and m.matched == "bc" and m.text == "za"


def test_include_stop_takes_the_longest_stop_at_the_same_start():
    m = StopMatcher(["ab", "abc"], include_stop=True)
    assert m.feed("xab") == ("x", False)  # "abc" may still complete
    assert m.feed("cd") == ("abc", True)
    assert m.text == "xabc"

    m = StopMatcher(["ab", "abc"], include_stop=True)
    m.feed("xab")
    assert m.feed("d") == ("ab", True)

    # Without the stop string in the output the choice does not matter: stop at once.
    m = StopMatcher(["ab", "abc"])
    assert m.feed("xab") == ("x", True)


def test_earliest_in_one_delta_and_nothing_after_stop():
    m = StopMatcher(["c", "b"])
    assert m.feed("aabcb") == ("aa", True)
    assert m.matched == "b"
    assert m.feed("more") == ("", True)
    assert m.flush() == "" and m.text == "aa"


def test_unicode_and_no_stops():
    m = StopMatcher(["😀!"])
    assert m.feed("hé😀") == ("hé", False)
    assert m.feed("!x") == ("", True)
    m = StopMatcher([])
    assert m.feed("any") == ("any", False)
    assert m.flush() == ""


def test_stop_at_the_very_start():
    m = StopMatcher(["<"], include_stop=True)
    assert m.feed("<tail") == ("<", True)


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [3]])
def test_invalid_stops(bad):
    with pytest.raises(ValueError, match="stops"):
        StopMatcher(bad)


# --- property test against the non-streaming reference --------------------------------------------

ALPHABET = "ab\né😀"


@st.composite
def streams(draw):
    text = draw(st.text(ALPHABET, max_size=24))
    stops = draw(st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4))
    # Bias towards stops that really occur, and towards stops that are prefixes of each other.
    if text and draw(st.booleans()):
        i = draw(st.integers(0, len(text) - 1))
        stops.append(text[i : i + draw(st.integers(1, 4))])
    if stops and draw(st.booleans()):
        s = draw(st.sampled_from(stops))
        stops.append(s[: draw(st.integers(1, len(s)))])
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    return text, stops, deltas, draw(st.booleans())


@settings(max_examples=400, deadline=None)
@given(streams())
def test_streaming_equals_reference(case):
    text, stops, deltas, include = case
    want, want_stop = reference(text, stops, include)
    cut = text.find(want_stop) if want_stop else None
    m = StopMatcher(stops, include_stop=include)
    emitted, fed = "", 0
    for d in deltas:
        out, stopped = m.feed(d)
        fed += len(d)
        emitted += out
        assert want.startswith(emitted)  # never past the cut, never into the stop string
        if not stopped or not include:
            assert not any(s in emitted for s in stops)
        assert stopped == decided(text[:fed], stops, include)  # stops as soon as it knows
        if not stopped:  # and holds back no more than it must
            assert emitted == text[: safe_len(text[:fed], stops)]
    emitted += m.flush()
    assert emitted == want == m.text
    assert m.stopped == (want_stop is not None)
    if want_stop is not None:
        assert text.startswith(m.matched, cut)
        if include:
            assert m.matched == want_stop
    if m.stopped:
        assert m.feed(text) == ("", True)
