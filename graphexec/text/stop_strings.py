"""Stop strings: where a request's decoded text must end, and how much of it to hold back.

A stop string can arrive split over several tokens, so a streamed delta must not show the start
of what may turn out to be a stop string: that tail is held back until the next tokens decide.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str]):
        self._stop = tuple(stop)
        self._longest = max((len(s) for s in self._stop), default=0)

    def __bool__(self) -> bool:
        return bool(self._stop)

    def find(self, text: str, new_from: int) -> int | None:
        """Index in `text` of the earliest stop string, or None.

        Only matches that end past `new_from` (the length of text searched before) are new, so
        each string is searched from `new_from - len(s) + 1`: proportional to the new text, and a
        match wholly inside text searched before (one min_tokens kept from counting) stays old.
        """
        hits = [i for i in (text.find(s, max(0, new_from - len(s) + 1)) for s in self._stop) if i >= 0]
        return min(hits, default=None)

    def held_back(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for size in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self._stop):
                return size
        return 0
