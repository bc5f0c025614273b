"""`FixedPolicy`: drafts what it is given: the request's k every round (fewer only near
max_new_tokens), a lookup match whole, every extension whole, the configured fan-out."""

from __future__ import annotations

from typing import Any

from specdec.gateway.names import KPolicy, Source
from specdec.gateway.outcome import Outcome
from specdec.gateway.round.policy.acceptance import SourcePriors
from specdec.gateway.round.policy.params import Estimate


class FixedPolicy:
    """The request's k every round; lookups and extensions whole; the configured fan-out."""

    kind = KPolicy.FIXED
    prefills_beside = False  # every round drafts the request's k
    estimate: Estimate | None = None  # a fixed policy prices nothing

    def __init__(self, fan_out: int = 0, priors: SourcePriors | None = None):
        self.fan_out = fan_out  # 0: the drafter's default
        self.priors = priors  # the gateway's acceptance per source, fed by every round

    def bind(self, drafter: Any, verifier: Any, fleet: Any = None) -> None:
        """Nothing to read from the placements."""

    def choose_k(self, max_k: int) -> int:
        return max_k

    def choose_fan_out(self, k: int, branch_k: int) -> int | None:
        return self.fan_out

    def choose_lookup_k(self, bound: int, source: str = Source.NGRAM) -> int:
        return max(0, bound)

    def lookup_or_model(self, source: str, length: int, max_k: int) -> int:
        return max(0, length)

    def choose_extension(self, k: int, available: int) -> int:
        return max(0, available)

    @staticmethod
    def tree_sizes(
        k: int, branches: int, bound: int, source: str = Source.NGRAM
    ) -> tuple[int, int]:
        """A lookup draft the policy sized to k tokens, with `branches` other candidates,
        as a tree of at most bound nodes: (the draft's tokens, each other branch's). Here
        each other branch gets k / (2 branches) tokens (at least one) and the draft what
        is left of the bound."""
        if k <= 0 or branches <= 0:
            return k, 0
        share = max(1, k // (2 * branches))
        return max(1, min(k, bound - branches * share)), share

    @staticmethod
    def model_tree(k: int, width: int, bound: int) -> tuple[int, int]:
        """The nodes a model draft of k tokens may add as a dynamic tree, at most bound, and
        the tokens continuing each continued leaf (DraftRequest.tree_nodes, tree_depth):
        here width - 1 leaves (the drafter's likeliest alternatives) continued by half the
        draft's length, shortened to fit the bound; where not even one token fits, half
        the draft's length (at least width - 1) of terminal leaves."""
        if k <= 0 or width <= 1:
            return 0, 0
        leaves = width - 1
        depth = max(1, k // 2)
        while depth > 0 and leaves * (1 + depth) > bound:
            depth -= 1
        if depth:
            return leaves * (1 + depth), depth
        return max(0, min(bound, max(width - 1, k // 2))), 0

    def observe(self, outcome: Outcome) -> None:
        """Nothing a round shows changes a fixed policy; the gateway's priors learn from it."""
        if self.priors is not None:
            self.priors.observe_outcome(outcome)
