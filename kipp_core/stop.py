"""Stop strings over streamed text.

The detokenizer hands over text a token at a time, and a stop string may span several tokens. The
matcher holds back any tail that could still become a stop string, so no part of one is ever
emitted, and cuts the output at the earliest stop occurrence, exactly as cutting the full text
with `str.find` would.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    """Streams text through, cutting it at the earliest occurrence of any stop string.

    `feed(delta)` returns the text that is safe to emit now and whether a stop was found. Among
    occurrences the earliest start wins; at the same start the longest stop wins. With
    `include_stop` the stop string itself is emitted too. Once stopped, nothing more is emitted.
    At the end of a stream that did not stop, `flush()` releases the held-back tail.
    """

    def __init__(self, stops: Iterable[str], include_stop: bool = False):
        self.stops = list(stops)
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError(f"stops must be non-empty strings, got {self.stops!r}")
        self.include_stop = include_stop
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._max_len = max(map(len, self.stops), default=0)
        self._pending = ""  # fed but not yet emitted
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._emitted)

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._pending + delta
        found = self._earliest(buf)
        partial = self._partial_start(buf)
        # A full match is final unless a stop that starts earlier (or, when the stop string is
        # emitted, a longer one at the same start) may still complete with later text.
        if found and (found[0] < partial or (found[0] == partial and not self.include_stop)):
            return self._finish(buf, *found), True
        self._pending = buf[partial:]
        return self._emit(buf[:partial]), False

    def flush(self) -> str:
        """End of stream: emit what was held back (up to a stop, if one is now certain)."""
        if self.stopped:
            return ""
        buf, self._pending = self._pending, ""
        found = self._earliest(buf)
        return self._finish(buf, *found) if found else self._emit(buf)

    def _earliest(self, buf: str) -> tuple[int, str] | None:
        best = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i, -len(s)) < (best[0], -len(best[1]))):
                best = (i, s)
        return best

    def _partial_start(self, buf: str) -> int:
        # Start of the longest tail of buf that is a proper prefix of some stop (len(buf) if none).
        for j in range(max(0, len(buf) - self._max_len + 1), len(buf)):
            tail = buf[j:]
            if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                return j
        return len(buf)

    def _finish(self, buf: str, i: int, stop: str) -> str:
        self.stopped, self.matched, self._pending = True, stop, ""
        return self._emit(buf[: i + len(stop)] if self.include_stop else buf[:i])

    def _emit(self, s: str) -> str:
        if s:
            self._emitted.append(s)
        return s
