"""OpenAI's Predicted Outputs: the text the caller expects (the file being edited), as one
more lookup source matched against the output as it grows.

While the output follows the prediction, the draft is the prediction's next tokens. Once
it departs, the longest suffix of the output (up to `max_n` tokens) found in the
prediction puts the cursor back, preferring the first occurrence at or after where the
output last followed it (an edit goes forward through the file).
"""

from __future__ import annotations

from collections.abc import Sequence


class PredictionMatcher:
    """The prediction's tokens and where the output stands in them."""

    def __init__(self, prediction: Sequence[int], max_n: int = 8):
        self.tokens = list(prediction)
        self.max_n = max_n
        # n-gram -> the positions right after its occurrences, ascending
        self._after: dict[tuple[int, ...], list[int]] = {}
        toks = self.tokens
        for j in range(1, len(toks)):
            for n in range(1, min(max_n, j) + 1):
                self._after.setdefault(tuple(toks[j - n : j]), []).append(j)
        self._origin: tuple[int, int] | None = None  # (output length, cursor) at the last draft
        self._floor = 0  # where the output last followed the prediction

    def cursor(self, output: Sequence[int]) -> int | None:
        """Where in the prediction the output's next token should come from, or None."""
        if not output:
            return 0 if self.tokens else None
        if self._origin is not None:
            length, start = self._origin
            moved = len(output) - length
            end = start + moved
            if (
                moved >= 0
                and end <= len(self.tokens)
                and list(output[length:]) == self.tokens[start:end]
            ):
                return end if end < len(self.tokens) else None
        for n in range(min(self.max_n, len(output)), 0, -1):
            after = self._after.get(tuple(output[-n:]))
            if after:
                return next((p for p in after if p >= self._floor), after[0])
        return None

    def propose(self, output: Sequence[int], k: int) -> list[int]:
        """Up to k tokens of the prediction that should come next."""
        at = self.cursor(output) if k > 0 else None
        if at is None:
            self._origin = None
            return []
        self._floor = at
        self._origin = (len(output), at)
        return self.tokens[at : at + k]
