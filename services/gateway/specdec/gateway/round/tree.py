"""A round's draft as a token tree (VerifyRequest.draft_parents): `DraftTree`.

A draft is a chain (its tokens, no parents) or a tree: each node's token and its parent,
-1 for a child of the context, else an earlier node. A tree's first `chain` nodes are its
first branch, the draft a chain would have been (the draft model's draft, or a lookup's
best candidate): SSD prepares for its outcomes, and the drafter caches it.

Several lookup matches (the n-gram index's occurrences, the suffix trie's most frequent
continuations, the request's own text and the cache of recent outputs) often continue the
context differently; verifying them together in one forward lets the round keep the
longest one the target accepts, where a chain would have bet on one (`merge`).
Candidates that share a prefix share its nodes; a prediction is grafted onto the draft
model's draft (or its tree) the same way (`graft`). The verdict names the path it
accepted (VerifyResponse.accepted_path): the methods here read a round's outcome from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DraftTree:
    """A draft's nodes: a chain (parents empty, chain 0) or a token tree."""

    tokens: tuple[int, ...] = ()  # [n] each node's token
    parents: tuple[int, ...] = ()  # [n] each node's parent (-1: the context); (): a chain
    chain: int = 0  # a tree's first branch: its nodes 0..chain-1; 0 for a chain

    @classmethod
    def of(cls, tokens: Iterable[int], parents: Iterable[int] = (), chain: int = 0) -> DraftTree:
        """A draft from any sequences (a response's repeated fields, lists); parents
        empty: a chain."""
        parents = tuple(parents)
        return cls(tuple(tokens), parents, chain if parents else 0)

    @classmethod
    def merge(cls, branches: Sequence[Sequence[int]], budget: int) -> DraftTree:
        """The branches merged into a tree of at most `budget` nodes. Nodes are numbered
        branch by branch, the first branch whole first (cutting the tree to its first n
        nodes keeps a tree, and keeps the first candidates longest): it is the tree's
        first branch. A branch's tokens shared with an earlier branch's prefix reuse its
        nodes. A merge that spells one path is a chain."""
        tokens: list[int] = []
        parents: list[int] = []
        for branch in branches:
            _graft(tokens, parents, branch, budget)
        return _tree(tokens, parents, min(len(branches[0]), budget) if branches else 0)

    def graft(self, branch: Sequence[int], budget: int) -> DraftTree:
        """This draft with a branch added, at most `budget` nodes in all: its tokens that
        a path of the draft already spells reuse that path's nodes (the first such
        child), the rest are new nodes numbered after the draft's. A chain's first
        branch is the chain; a graft that only continues it is a longer chain."""
        tokens = list(self.tokens)
        parents = list(self.parents) if self.parents else list(range(-1, len(tokens) - 1))
        _graft(tokens, parents, branch, budget)
        return _tree(tokens, parents, self.chain if self.parents else len(self.tokens))

    @property
    def is_chain(self) -> bool:
        return not self.parents

    @property
    def first_branch(self) -> tuple[int, ...]:
        """The draft a chain would be: a tree's first branch (its first nodes), a chain whole."""
        return self.tokens[: self.chain] if self.parents else self.tokens

    @property
    def width(self) -> int:
        """Branches at the root (1: a chain)."""
        return sum(p == -1 for p in self.parents) if self.parents else 1

    def leaves(self) -> tuple[int, int]:
        """A drafter's tree (its first `chain` nodes the draft, then its leaves, then their
        continuations): (its leaves, the longest continuation below one); (0, 0): a chain."""
        depth = [0] * len(self.parents)
        leaves = 0
        for i in range(self.chain, len(self.parents)):
            if self.parents[i] < self.chain:
                leaves += 1
            else:
                depth[i] = depth[self.parents[i]] + 1
        return leaves, max(depth, default=0)

    def on_chain(self, path: Sequence[int]) -> int:
        """The accepted path's nodes on a tree's first branch (nodes 0..chain-1); 0 for a
        chain."""
        n = 0
        while n < len(path) and n < self.chain and path[n] == n:
            n += 1
        return n

    def accepted_on_chain(self, accepted: int, path: Sequence[int]) -> int:
        """Of a verdict's accepted tokens, those on the first branch: a chain's all of
        them, a tree's the path's nodes on it (what the drafter's cache keeps)."""
        return self.on_chain(path) if self.parents else accepted

    def branch(self, path: Sequence[int]) -> int | None:
        """Which branch the accepted path took: 0 the first (a chain's own draft, the
        first `chain` nodes of a tree), else the index of its root branch, or 1 when it
        left the first branch below the root; None when nothing was accepted."""
        if not path:
            return None
        if not self.parents or self.on_chain(path) == len(path):
            return 0
        return [i for i, p in enumerate(self.parents) if p == -1].index(path[0]) or 1

    def path_first(self, path: Sequence[int]) -> tuple[int, ...]:
        """The draft's tokens with the accepted path first (a chain's as they are)."""
        if not path:
            return self.tokens
        on = set(path)
        tokens = self.tokens
        return (*(tokens[i] for i in path), *(t for i, t in enumerate(tokens) if i not in on))

    def cut(self, keep: int) -> DraftTree:
        """A chain's first `keep` tokens (a grammar's cut: grammars verify chains only)."""
        assert not self.parents, "a grammar cuts chains only"
        return DraftTree(self.tokens[:keep])


def _tree(tokens: list[int], parents: list[int], chain: int) -> DraftTree:
    """A merge's or a graft's nodes: a chain when they spell one path (node i's parent is
    i - 1), else a tree whose first branch is its first `chain` nodes."""
    if all(p == i - 1 for i, p in enumerate(parents)):
        return DraftTree(tuple(tokens))
    return DraftTree(tuple(tokens), tuple(parents), chain)


def _graft(tokens: list[int], parents: list[int], branch: Sequence[int], budget: int) -> None:
    """Add a branch to a tree (tokens, parents, in place) of at most `budget` nodes."""
    at = -1
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
        at = node
