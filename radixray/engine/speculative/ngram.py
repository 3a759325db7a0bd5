"""Draft proposal from an n-gram index over one request's tokens (prompt + output).

The index maps every ``min_window``-gram of the sequence to the positions right after
its occurrences. A proposal looks up the sequence's last ``min_window`` tokens, extends
each recent occurrence's match backwards up to ``max_window`` tokens, and copies what
followed the longest (then the most recent) match. The copy may run into the sequence's
own end and continue from the tokens it just copied, so a cycle shorter than the draft
still yields a full draft.
"""

from __future__ import annotations

# Occurrences of the last min_window tokens looked at per proposal (the most recent ones).
MAX_CANDIDATES = 16


class NgramIndex:
    """The n-gram index of one token sequence that only grows (a request's ``all_ids``).

    ``propose`` indexes the tokens added since its last call, so a proposal costs the new
    tokens plus at most ``MAX_CANDIDATES * max_window`` comparisons.
    """

    def __init__(self, min_window: int, max_window: int):
        if not 1 <= min_window <= max_window:
            raise ValueError(f"need 1 <= min_window <= max_window, got {min_window}, {max_window}")
        self.min_window, self.max_window = min_window, max_window
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions after it
        self.indexed = 0  # positions e < indexed are in ``ends``

    def _index(self, tokens: list[int]) -> None:
        """Record each n-gram ``tokens[e-w:e]`` followed by a token (``e < len(tokens)``)."""
        w = self.min_window
        for e in range(max(self.indexed, w), len(tokens)):
            self.ends.setdefault(tuple(tokens[e - w:e]), []).append(e)
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``limit`` tokens predicted to follow ``tokens``; [] without a match of at
        least ``min_window`` tokens. ``tokens`` must extend the sequence of earlier calls."""
        self._index(tokens)
        n, w = len(tokens), self.min_window
        if limit <= 0 or n < w:
            return []
        cands = self.ends.get(tuple(tokens[n - w:]))
        if not cands:
            return []
        best, best_len = -1, 0
        for e in reversed(cands[-MAX_CANDIDATES:]):
            m = w
            while m < self.max_window and e - m - 1 >= 0 and tokens[e - m - 1] == tokens[n - m - 1]:
                m += 1
            if m > best_len:
                best, best_len = e, m
                if m == self.max_window:
                    break
        draft: list[int] = []
        for i in range(limit):
            j = best + i
            draft.append(tokens[j] if j < n else draft[j - n])
        return draft
