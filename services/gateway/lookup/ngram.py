"""Prompt lookup (n-gram): the longest recent n-gram of the sequence that occurred earlier
proposes what followed it there.

`NgramIndex` keeps, for every n in [min_n, max_n], a dict from each n-gram of the
sequence to the position right after its latest occurrence that has a continuation. It is
updated as the sequence grows (`extend`: max_n - min_n + 1 dict writes per token), so a
round costs a few dict look-ups whatever the context length, instead of vLLM's KMP scan
of the whole context every step. The latest occurrence wins: in an edit or a multi-turn
chat the most recent copy of a line is the one most likely to be continued.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """n-grams of one growing token sequence -> where their latest continuation starts."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}"
            )
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens; each indexes the n-grams it continues (those ending before it)."""
        toks, after = self.tokens, self._after
        for t in new:
            j = len(toks)
            for n in range(self.min_n, min(self.max_n, j) + 1):
                after[tuple(toks[j - n : j])] = j
            toks.append(t)

    def match(self) -> tuple[int, int] | None:
        """(where the continuation starts, n) for the longest n-gram ending the sequence
        that occurred earlier with a continuation; None when no n in [min_n, max_n] did."""
        toks, length = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = self._after.get(tuple(toks[length - n :]))
            if start is not None:
                return start, n
        return None

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the match, and the match's length (0: none)."""
        if k <= 0:
            return [], 0
        found = self.match()
        if found is None:
            return [], 0
        return copy_after(self.tokens, found[0], k), found[1]


def copy_after(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens copied from tokens[start:], continued past the end the way an overlapping
    copy does (LZ77): a sequence that repeats with period len(tokens) - start keeps
    repeating, instead of the proposal stopping at the end of what exists."""
    length, out = len(tokens), []
    for i in range(k):
        p = start + i
        out.append(tokens[p] if p < length else out[p - length])
    return out
