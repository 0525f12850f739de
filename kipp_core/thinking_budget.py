"""The thinking budget (vLLM's `thinking_token_budget`): after N tokens of thought the engine
closes the thought itself, a forced token at a time, and the answer follows.

A thought opens at the end of the prompt (a prompt ending in `<think>` or `<think>\\n`, as
Thinking-2507's generation prompt does) or at an output that starts with `<think>`; an output that
starts otherwise has no thought and the budget does nothing. It counts the tokens after
`<think>`, closes by itself at `</think>`, and once N are counted the next tokens are forced to
`\\n</think>\\n\\n`: a closed thought as the chat template writes one, so that the message renders
back the way the model saw it. A forced token is a one-token mask (SamplerState.allowed), so it
works on every backend, seeded sampling included; where a structured-outputs mask refuses the
blank line after `</think>`, the constraint has the last word.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CLOSING = "\n</think>\n\n"


class _Phase(enum.Enum):
    UNDECIDED = enum.auto()  # no output yet: the first token says whether a thought opens
    OPEN = enum.auto()
    CLOSING = enum.auto()  # the budget is spent: CLOSING's tokens are forced
    DONE = enum.auto()  # closed, or never opened: the budget has nothing more to do


class ThinkTokens:
    """A tokenizer's thought markers: `<think>`, `</think>` and the closing sequence's ids, and
    one read-only one-token mask for each of those."""

    def __init__(self, tokenizer, vocab_size: int):
        self.open_id = tokenizer.token_to_id(THINK_OPEN)
        self.close_id = tokenizer.token_to_id(THINK_CLOSE)
        if self.open_id is None or self.close_id is None:
            raise ValueError("thinking_token_budget needs a vocabulary with <think> and </think>")
        self.closing = tuple(tokenizer.encode(CLOSING))
        self.vocab_size = vocab_size
        self._masks: dict[int, np.ndarray] = {}

    def opens(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt ends inside an opened thought."""
        tail = list(prompt_token_ids[-2:])
        return tail[-1:] == [self.open_id] or tail == [self.open_id, self.closing[0]]

    def only(self, token: int) -> np.ndarray:
        m = self._masks.get(token)
        if m is None:
            m = np.zeros(self.vocab_size, dtype=bool)
            m[token] = True
            m.flags.writeable = False
            self._masks[token] = m
        return m


class Thought:
    """One sequence's thought under a budget, read from its output tokens as they come."""

    def __init__(self, tokens: ThinkTokens, budget: int, prompt_token_ids: Sequence[int]):
        self.tokens, self.budget = tokens, budget
        self.count = 0  # tokens of thought so far
        self.num_read = 0
        self._pos = 0  # the next closing token, while CLOSING
        self._phase = _Phase.UNDECIDED
        if tokens.opens(prompt_token_ids):
            self._open()

    @property
    def done(self) -> bool:
        return self._phase is _Phase.DONE

    def _open(self) -> None:
        self._phase = _Phase.OPEN
        if self.count >= self.budget:
            self._phase, self._pos = _Phase.CLOSING, 0

    def read(self, output_token_ids: Sequence[int]) -> None:
        for tok in output_token_ids[self.num_read :]:
            phase = self._phase
            if phase is _Phase.UNDECIDED:
                if tok == self.tokens.open_id:
                    self._open()
                else:
                    self._phase = _Phase.DONE
            elif phase is _Phase.OPEN:
                if tok == self.tokens.close_id:
                    self._phase = _Phase.DONE
                else:
                    self.count += 1
                    self._open()
            elif phase is _Phase.CLOSING:
                self._pos += 1
                if self._pos == len(self.tokens.closing):
                    self._phase = _Phase.DONE
        self.num_read = len(output_token_ids)

    def forced(self, output_token_ids: Sequence[int]) -> int | None:
        """The token the next step must sample, or None where the model chooses."""
        self.read(output_token_ids)
        return self.tokens.closing[self._pos] if self._phase is _Phase.CLOSING else None

    def mask(self, output_token_ids: Sequence[int], allowed: np.ndarray | None):
        """The next token's mask: `allowed` (a structured-outputs mask, or None), or the forced
        closing token alone; a constraint that refuses that token ends the forcing."""
        tok = self.forced(output_token_ids)
        if tok is None:
            return allowed
        if allowed is not None and not allowed[tok]:
            self._phase = _Phase.DONE
            return allowed
        return self.tokens.only(tok)

    def may_force(self, output_token_ids: Sequence[int], num_pending: int) -> bool:
        """Whether the token after `num_pending` samples still on the device could be forced:
        then async scheduling must wait for them (their values decide it)."""
        self.read(output_token_ids)
        if self._phase is _Phase.DONE:
            return False
        if self._phase is _Phase.CLOSING:
            return True
        # at most this many tokens of thought once the pending ones are read
        most = self.count + num_pending if self._phase is _Phase.OPEN else num_pending - 1
        return most >= self.budget

    def room(self, output_token_ids: Sequence[int]) -> int | None:
        """How many draft tokens speculation may propose before the budget (None: no limit):
        the drafts and the bonus token must all fit in what is left of it."""
        self.read(output_token_ids)
        if self._phase is _Phase.CLOSING:
            return 0
        if self._phase is _Phase.OPEN:
            return self.budget - self.count - 1
        return None
