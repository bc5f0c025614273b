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

Its cost is memory: up to `depth` nodes per token (about 100 bytes each: flat arrays and
one dict of ints, see `SuffixTrie`), so the per-gateway cache is bounded in tokens
(`SuffixCache`).

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
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.gateway.observe import metrics
from specdec.gateway.round.lookup.settings import SuffixParams

_SHIFT = 32  # a child's key: parent id << 32 | token id (token ids < 2^32)


@dataclass(frozen=True, slots=True)
class SuffixDraft:
    tokens: list[int]  # [k]
    score: float  # expected accepted tokens: the sum of the path's probabilities
    match_length: int  # tokens of the context the draft continues


NO_DRAFT = SuffixDraft([], 0.0, 0)


class SuffixTrie:
    """Substrings of up to `depth` tokens with their counts.

    Nodes are integers and live in flat arrays (count, the sum of the children's counts,
    the most frequent child, a linked list of children), the edges in one dict from
    `parent << 32 | token` to the child: no Python object per node, so a trie of millions
    of nodes costs the garbage collector nothing (ints and a dict of ints are not
    tracked), and a node costs about 100 bytes instead of about 300."""

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"suffix depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = 0
        self._edges: dict[int, int] = {}
        self.count = array("q", [0])  # [nodes] occurrences of the node's substring
        self.total = array("q", [0])  # [nodes] sum of its children's counts
        self.best = array("q", [-1])  # [nodes] its child with the highest count, -1: none
        self.token = array("q", [-1])  # [nodes] the token of the edge into it
        self.first = array("q", [-1])  # [nodes] its first child, -1: none
        self.sibling = array("q", [-1])  # [nodes] the next child of its parent, -1: none
        self._free: list[int] = []

    @property
    def nodes(self) -> int:
        """Nodes besides the root."""
        return len(self._edges)

    def child(self, node: int, token: int) -> int | None:
        return self._edges.get(node << _SHIFT | token)

    def _new(self, parent: int, token: int) -> int:
        if self._free:
            node = self._free.pop()
            self.count[node] = self.total[node] = 0
            self.best[node] = self.first[node] = -1
            self.token[node] = token
        else:
            node = len(self.count)
            self.count.append(0)
            self.total.append(0)
            self.best.append(-1)
            self.token.append(token)
            self.first.append(-1)
            self.sibling.append(-1)
        self.sibling[node] = self.first[parent]
        self.first[parent] = node
        self._edges[parent << _SHIFT | token] = node
        return node

    def bump(self, parent: int, token: int) -> int:
        """Count one more occurrence of parent's substring followed by token; the child."""
        node = self._edges.get(parent << _SHIFT | token)
        if node is None:
            node = self._new(parent, token)
        count = self.count[node] + 1
        self.count[node] = count
        self.total[parent] += 1
        best = self.best[parent]
        if best < 0 or (best != node and count > self.count[best]):
            self.best[parent] = node
        return node

    def _drop(self, parent: int, node: int) -> None:
        """Take a node whose count fell to 0 (and whose children are gone) out."""
        prev, x = -1, self.first[parent]
        while x != node:
            prev, x = x, self.sibling[x]
        if prev < 0:
            self.first[parent] = self.sibling[node]
        else:
            self.sibling[prev] = self.sibling[node]
        del self._edges[parent << _SHIFT | self.token[node]]
        self._free.append(node)

    def _rebest(self, parent: int) -> None:
        best, x = -1, self.first[parent]
        while x >= 0:
            if best < 0 or self.count[x] > self.count[best]:
                best = x
            x = self.sibling[x]
        self.best[parent] = best

    def add(self, seq: Sequence[int], weight: int = 1) -> None:
        """Count every substring of seq of up to `depth` tokens `weight` more times
        (negative: fewer, and the nodes that reach 0 are dropped)."""
        if weight > 0:
            for _ in range(weight):
                grow(self, [], seq)
            return
        depth = self.depth
        for i in range(len(seq)):
            path, node = [], self.root
            for t in seq[i : i + depth]:
                child = self._edges.get(node << _SHIFT | t)
                if child is None:
                    break
                path.append((node, child))
                node = child
            for parent, child in path:
                self.count[child] += weight
                self.total[parent] += weight
            for parent, child in reversed(path):  # children before their parents
                if self.count[child] <= 0:
                    self._drop(parent, child)
                if self.best[parent] == child or self.count[child] <= 0:
                    self._rebest(parent)

    def find(self, seq: Sequence[int], start: int, end: int) -> int | None:
        node, edges = self.root, self._edges
        for i in range(start, end):
            child = edges.get(node << _SHIFT | seq[i])
            if child is None:
                return None
            node = child
        return node

    def match(self, seq: Sequence[int], max_match: int) -> tuple[int, int] | None:
        """The node of the longest suffix of seq (<= max_match tokens) that has a
        continuation, and its length."""
        end = len(seq)
        for start in range(max(0, end - min(max_match, self.depth - 1)), end):
            node = self.find(seq, start, end)
            if node is not None and self.first[node] >= 0:
                return node, end - start
        return None


class Grower:
    """A request's own trie, grown one token at a time: `active[i]` is the node of the
    suffix of i + 1 tokens ending at the last token (lengths 1 .. depth - 1)."""

    def __init__(self, depth: int):
        self.trie = SuffixTrie(depth)
        self.tokens: list[int] = []
        self._active: list[int] = []

    def extend(self, new: Sequence[int]) -> None:
        self._active = grow(self.trie, self._active, new)
        self.tokens.extend(new)


def grow(trie: SuffixTrie, active: list[int], new: Sequence[int]) -> list[int]:
    """Count the substrings that each token of `new` ends, given the nodes of the
    suffixes that end before it (`active`, shortest first); returns those after the last
    token. O(depth) dict operations per token: SuffixTrie.bump, inlined."""
    limit = trie.depth - 1
    edges, count, total, best_of, root = trie._edges, trie.count, trie.total, trie.best, trie.root
    for t in new:
        nxt: list[int] = []
        for parent in (root, *active):
            node = edges.get(parent << _SHIFT | t)
            if node is None:
                node = trie._new(parent, t)
            c = count[node] + 1
            count[node] = c
            total[parent] += 1
            best = best_of[parent]
            if best < 0 or (best != node and c > count[best]):
                best_of[parent] = node
            if len(nxt) < limit:
                nxt.append(node)
        active = nxt
    return active


def draft(trie: SuffixTrie, ctx: Sequence[int], k: int, p: SuffixParams) -> SuffixDraft:
    """Suffix decoding's draft of at most k tokens after ctx from one trie."""
    found = branches(trie, ctx, k, p, 1)
    return found[0] if found else NO_DRAFT


def branches(
    trie: SuffixTrie, ctx: Sequence[int], k: int, p: SuffixParams, width: int
) -> list[SuffixDraft]:
    """Up to `width` drafts of at most k tokens after ctx, one through each of the most
    frequent continuations of the match (the most frequent first: suffix decoding's own
    draft), each then following the most frequent child as `draft` does; a branch whose
    first token's probability is below min_prob is left out."""
    if k <= 0 or width <= 0:
        return []
    found = trie.match(ctx, p.max_match)
    if found is None:
        return []
    node, match_length = found
    k = min(k, math.ceil(match_length * p.spec_factor))
    best = trie.best[node]
    others, x = [], trie.first[node]
    while x >= 0:
        if x != best:
            others.append(x)
        x = trie.sibling[x]
    others.sort(key=lambda c: -trie.count[c])
    out = []
    for first in [best, *others][:width]:
        found_draft = _follow(trie, ctx, node, first, k, p)
        if found_draft is not None:
            out.append(SuffixDraft(found_draft[0], found_draft[1], match_length))
    return out


def _follow(
    trie: SuffixTrie, ctx: Sequence[int], node: int, first: int, k: int, p: SuffixParams
) -> tuple[list[int], float] | None:
    """From the match's node through its child `first`, then the most frequent child:
    (tokens, score), or None when `first` is below min_prob."""
    out: list[int] = []
    prob, score = 1.0, 0.0
    tail: list[int] | None = None
    count, total, best_of, token = trie.count, trie.total, trie.best, trie.token
    while len(out) < k:
        best = first if not out else best_of[node]
        if best < 0:  # the trie's depth: match again on ctx + the draft so far
            if tail is None:
                tail = list(ctx[-p.max_match :])
            again = trie.match([*tail, *out], p.max_match)
            if again is None:
                break
            node = again[0]
            best = best_of[node]
        prob *= count[best] / total[node]
        if prob < p.min_prob:
            break
        out.append(token[best])
        score += prob
        node = best
    return (out, score) if out else None


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
            if not old_trie.nodes:
                del self.tries[old_key]
            metrics.SUFFIX_CACHE_EVICTIONS.inc()
        metrics.SUFFIX_CACHE_TOKENS.set(self.tokens)
        metrics.SUFFIX_CACHE_ENTRIES.set(len(self._entries))

    def draft(self, key: str, ctx: Sequence[int], k: int) -> SuffixDraft:
        """The cache's draft for ctx under `key`; counts a look-up, and a hit when it
        proposes something."""
        found = self.branches(key, ctx, k, 1)
        return found[0] if found else NO_DRAFT

    def branches(self, key: str, ctx: Sequence[int], k: int, width: int) -> list[SuffixDraft]:
        """The cache's drafts for ctx under `key`, up to `width` of them (`branches`);
        counts a look-up, and a hit when it proposes something."""
        self.lookups += 1
        metrics.SUFFIX_CACHE_LOOKUPS.inc()
        trie = self.tries.get(key)
        if trie is None:
            return []
        found = branches(trie, ctx, k, self.params, width)
        if found:
            self.hits += 1
            metrics.SUFFIX_CACHE_HITS.inc()
        return found

    @property
    def nodes(self) -> int:
        return sum(t.nodes for t in self.tries.values())
