"""Suffix decoding: a bounded-depth suffix trie with counts, per request and per gateway.

The structure. A `SuffixTrie` holds every substring of up to `depth` tokens of the
sequences put in it, as paths from the root; each node counts how often its substring
occurred. This is the suffix tree of Arctic Inference's suffix decoding cut at a fixed
depth (it keeps 24-64), stored uncompressed:

- it grows online: appending a token to a request's sequence extends the `depth` nodes
  of the suffixes that end at the previous token (`Grower.append`: O(depth) dict
  operations per token, no rescan), where Ukkonen's construction of a full suffix tree
  would need suffix links and edge splitting for the same answers within `depth`;
- the counts give what suffix decoding needs and a suffix automaton does not keep online:
  how often each continuation followed the matched text;
- removing a sequence (the cache's eviction) is the insertion with -1 counts, dropping the
  nodes that reach 0.

Its cost is memory: up to `depth` nodes per token (about 200 bytes each in CPython), so the
per-gateway cache is bounded in tokens (`SuffixCache`).

The draft (as in suffix decoding). Find the longest suffix of the context, at most
`max_match` tokens, that is a path of the trie with a continuation. From its node follow
the most frequent child while the product of the children's frequencies (count / sum of
the siblings' counts) stays >= `min_prob` (Arctic's 0.1), for at most
`ceil(match length x spec_factor)` tokens and the round's bound. When the path reaches the
trie's depth the match is taken again on the context plus the draft so far. The sum of
those products is the draft's score: the tokens it is expected to get accepted.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.gateway import metrics


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    tokens: list[int]  # [k]
    score: float  # expected accepted tokens: the sum of the path's probabilities
    match_length: int  # tokens of the context the draft continues


NO_DRAFT = SuffixDraft([], 0.0, 0)


class SuffixTrie:
    """Substrings of up to `depth` tokens with their counts."""

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.nodes = 0

    def add(self, seq: Sequence[int], weight: int = 1) -> None:
        """Count every substring of seq of up to `depth` tokens `weight` more times
        (negative: fewer; nodes that reach 0 are dropped)."""
        depth = self.depth
        for i in range(len(seq)):
            node = self.root
            for t in seq[i : i + depth]:
                child = node.children.get(t)
                if child is None:
                    if weight < 0:
                        break
                    child = node.children[t] = _Node()
                    self.nodes += 1
                child.count += weight
                if child.count <= 0:
                    self.nodes -= _size(child)
                    del node.children[t]
                    break
                node = child

    def find(self, seq: Sequence[int], start: int, end: int) -> _Node | None:
        node = self.root
        for i in range(start, end):
            node = node.children.get(seq[i])
            if node is None:
                return None
        return node

    def match(self, seq: Sequence[int], max_match: int) -> tuple[_Node, int] | None:
        """The node of the longest suffix of seq (<= max_match tokens) that has a
        continuation, and its length."""
        end = len(seq)
        for start in range(max(0, end - min(max_match, self.depth - 1)), end):
            node = self.find(seq, start, end)
            if node is not None and node.children:
                return node, end - start
        return None


def _size(node: _Node) -> int:
    stack, n = [node], 0
    while stack:
        x = stack.pop()
        n += 1
        stack.extend(x.children.values())
    return n


class Grower:
    """A request's own trie, grown one token at a time: `active[i]` is the node of the
    suffix of i + 1 tokens ending at the last token (lengths 1 .. depth - 1)."""

    def __init__(self, depth: int):
        self.trie = SuffixTrie(depth)
        self.tokens: list[int] = []
        self._active: list[_Node] = []

    def extend(self, new: Sequence[int]) -> None:
        trie, limit = self.trie, self.trie.depth - 1
        for t in new:
            nxt = []
            for node in (trie.root, *self._active):
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = _Node()
                    trie.nodes += 1
                child.count += 1
                if len(nxt) < limit:
                    nxt.append(child)
            self._active = nxt
            self.tokens.append(t)


@dataclass(frozen=True)
class SuffixParams:
    depth: int = 24  # Arctic Inference's smallest max_tree_depth
    max_match: int = 12  # longest suffix matched: leaves depth - max_match tokens of path
    spec_factor: float = 1.0  # draft at most ceil(match length x spec_factor) tokens
    min_prob: float = 0.1  # stop where the path's probability falls below this


def draft(trie: SuffixTrie, ctx: Sequence[int], k: int, p: SuffixParams) -> SuffixDraft:
    """Suffix decoding's draft of at most k tokens after ctx from one trie."""
    if k <= 0:
        return NO_DRAFT
    found = trie.match(ctx, p.max_match)
    if found is None:
        return NO_DRAFT
    node, match_length = found
    k = min(k, math.ceil(match_length * p.spec_factor))
    out: list[int] = []
    prob, score = 1.0, 0.0
    tail: list[int] | None = None
    while len(out) < k:
        if not node.children:  # the trie's depth: match again on ctx + the draft so far
            if tail is None:
                tail = list(ctx[-p.max_match :])
            again = trie.match([*tail, *out], p.max_match)
            if again is None:
                break
            node = again[0]
        total = 0
        best_token, best = -1, None
        for t, child in node.children.items():
            total += child.count
            if best is None or child.count > best.count:
                best_token, best = t, child
        prob *= best.count / total
        if prob < p.min_prob:
            break
        out.append(best_token)
        score += prob
        node = best
    return SuffixDraft(out, score, match_length)


class SuffixCache:
    """Recent outputs of every request of this gateway, in one trie per scope key (one
    key under scope `global`, the tenant under `tenant`), bounded in tokens over all keys.

    Entries are whole outputs, evicted least recently used first; an output identical to
    a cached one is used again: it moves to the most recent end and counts once more."""

    def __init__(self, max_tokens: int, params: SuffixParams):
        self.max_tokens = max_tokens
        self.params = params
        self.tries: dict[str, SuffixTrie] = {}
        # (key, tokens) -> times inserted, oldest first
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], int] = OrderedDict()
        self.tokens = 0  # tokens of the cached outputs (each entry once)
        self.lookups = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: str, output: Sequence[int]) -> None:
        """Cache a finished output (the last max_tokens of it when longer)."""
        seq = tuple(output[-self.max_tokens :]) if self.max_tokens else ()
        if not seq:
            return
        entry = (key, seq)
        trie = self.tries.get(key)
        if trie is None:
            trie = self.tries[key] = SuffixTrie(self.params.depth)
        trie.add(seq)
        if entry in self._entries:
            self._entries[entry] += 1
            self._entries.move_to_end(entry)
        else:
            self._entries[entry] = 1
            self.tokens += len(seq)
        while self.tokens > self.max_tokens:
            (old_key, old), times = self._entries.popitem(last=False)
            self.tokens -= len(old)
            old_trie = self.tries[old_key]
            old_trie.add(old, -times)
            if not old_trie.root.children:
                del self.tries[old_key]
            metrics.SUFFIX_CACHE_EVICTIONS.inc()
        metrics.SUFFIX_CACHE_TOKENS.set(self.tokens)
        metrics.SUFFIX_CACHE_ENTRIES.set(len(self._entries))

    def draft(self, key: str, ctx: Sequence[int], k: int) -> SuffixDraft:
        """The cache's draft for ctx under `key`; counts a look-up, and a hit when it
        proposes something."""
        self.lookups += 1
        metrics.SUFFIX_CACHE_LOOKUPS.inc()
        trie = self.tries.get(key)
        if trie is None:
            return NO_DRAFT
        found = draft(trie, ctx, k, self.params)
        if found.tokens:
            self.hits += 1
            metrics.SUFFIX_CACHE_HITS.inc()
        return found

    @property
    def nodes(self) -> int:
        return sum(t.nodes for t in self.tries.values())
