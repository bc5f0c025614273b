"""How big a draft tree pays (the adaptive policy's `tree_sizes` and `model_tree`): the
search over a tree's sizes for the most expected tokens per second, given what the
policy measured (expected accepted tokens) and its price of a round of so many nodes."""

from __future__ import annotations

from collections.abc import Callable


def _better(rate: float, best: float) -> bool:
    return rate > best * (1.0 + 1e-9)  # ties to the smaller tree


def lookup_tree_sizes(
    own: list[float],
    missed: float,
    other: list[float],
    k: int,
    branches: int,
    bound: int,
    time: Callable[[int], float],
) -> tuple[int, int]:
    """A lookup draft sized to k tokens, with `branches` other candidates, as a tree of at
    most bound nodes: (the draft's tokens c, each other branch's s), the pair that
    maximises expected tokens per second,
    (1 + E_draft(c) + (1 - a(0)) E_other(s)) / V(1 + c + s branches):
    own[c] = E_draft(c), the draft source's expected accepted tokens; missed = 1 - a(0);
    other[s] = E_other(s), the measured acceptance of the other branches in rounds whose
    draft failed at its first token; time(nodes) = V(1 + nodes), the round's price. s = 0
    is a chain of k: a steep curve (compute-bound verification) gives it."""
    best, best_rate = (k, 0), 0.0
    for c in range(1, k + 1):
        for s in range((bound - c) // branches + 1):
            rate = (1.0 + own[c] + missed * other[s]) / time(c + s * branches)
            if _better(rate, best_rate):
                best, best_rate = (c, s), rate
    return best


def model_tree_sizes(
    expected: list[float],
    g: float,
    acceptance: float,
    k: int,
    width: int,
    bound: int,
    time: Callable[[int, int], float],
) -> tuple[int, int]:
    """The nodes a model draft of k tokens may add and the tokens continuing each
    continued leaf (DraftRequest.tree_nodes, tree_depth): the (n, D) with n in 0..bound
    that maximises expected tokens per second,
    (1 + E(k) + g (r (1 + E(D)) + t (1 - a))) / (V(1 + k + n) + D(k + D) (1 - h)):
    r = n // (1 + D) leaves continued by D tokens (0 when D is 0), t = n - r (1 + D)
    terminal ones, at most k (width - 1) leaves (the alternatives there are); g the
    measured rate of rounds whose path took a leaf, per leaf sent; E = expected, the
    model's expected accepted tokens (a continuation is the drafter drafting after a token
    it got right); a = acceptance; time(n, D) the round's price, the Draft with D more
    forwards. A taken terminal leaf only moves a token between rounds
    (docs/concepts/trees.md) unless the position after it is a miss too, which saves
    that round: it is worth 1 - a; a continued one spares the next round the tokens it
    drew. A steep cost curve gives (0, 0): a chain; a costly drafter forward gives D = 0."""
    most = k * (width - 1)
    best, best_rate = (0, 0), 0.0
    for depth in range(min(k, bound - 1) + 1):
        for n in range(1 if depth else 0, bound + 1):
            rows = n // (1 + depth) if depth else 0
            terminal = n - rows * (1 + depth)
            if rows + terminal > most or (depth and rows == 0):
                continue
            gain = g * (rows * (1.0 + expected[depth]) + terminal * (1.0 - acceptance))
            rate = (1.0 + expected[k] + gain) / time(n, depth)
            if _better(rate, best_rate):
                best, best_rate = (n, depth), rate
    return best
