"""Candidate continuations as one token tree (VerifyRequest.draft_parents).

Several lookup matches (the n-gram index's occurrences, the suffix trie's most frequent
continuations, the request's own text and the cache of recent outputs) often continue the
context differently; verifying them together in one forward lets the round keep the
longest one the target accepts, where a chain would have bet on one. Candidates that
share a prefix share its nodes; a prediction is grafted onto the draft model's draft (or
its tree) the same way.
"""

from __future__ import annotations

from collections.abc import Sequence


def merge(branches: Sequence[Sequence[int]], budget: int) -> tuple[list[int], list[int]]:
    """The branches merged into a token tree of at most `budget` nodes: (tokens, parents),
    parents[i] -1 for a child of the context, else an earlier node. Nodes are numbered
    branch by branch, the first branch whole first (cutting the tree to its first n nodes
    keeps a tree, and keeps the first candidates longest); a branch's tokens shared with an
    earlier branch's prefix reuse its nodes."""
    tokens: list[int] = []
    parents: list[int] = []
    for branch in branches:
        graft(tokens, parents, branch, budget)
    return tokens, parents


def graft(tokens: list[int], parents: list[int], branch: Sequence[int], budget: int) -> int:
    """Add a branch to a tree (tokens, parents, in place) of at most `budget` nodes: its
    tokens that an existing path already spells reuse that path's nodes (the first such
    child), the rest are new nodes numbered after the tree's. Returns the nodes added."""
    added, at = 0, -1
    for token in branch:
        node = next(
            (i for i in range(len(tokens)) if parents[i] == at and tokens[i] == token), None
        )
        if node is None:
            if len(tokens) >= budget:
                break
            node = len(tokens)
            tokens.append(token)
            parents.append(at)
            added += 1
        at = node
    return added


def is_chain(parents: Sequence[int]) -> bool:
    """Whether a tree is a chain (node i's parent is i - 1)."""
    return all(p == i - 1 for i, p in enumerate(parents))
