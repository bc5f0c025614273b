"""The lookup proposers (specdec.gateway.round.lookup): match selection, n-gram bounds, the
suffix trie and its draft, the cache's bound, eviction and tenant isolation, predictions,
and the draft bounds the round puts on them."""

from __future__ import annotations

import random

import pytest

from specdec.gateway.round.lookup import HYBRID, MODEL, NGRAM, PREDICTION, SUFFIX, parse_method
from specdec.gateway.round.lookup.hybrid import RequestLookup
from specdec.gateway.round.lookup.ngram import NgramIndex, copy_after
from specdec.gateway.round.lookup.prediction import PredictionMatcher
from specdec.gateway.round.lookup.settings import LookupSettings
from specdec.gateway.round.lookup.suffix import (
    Grower,
    SuffixCache,
    SuffixParams,
    SuffixTrie,
    draft,
)
from specdec.v1 import gateway_pb2


def ngram(tokens, min_n=2, max_n=4):
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


# -- ngram ------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_match():
    # "7 8 9" occurred twice: after "1 7 8 9" came 4, after "2 7 8 9" came 5. The sequence
    # ends with "1 7 8 9": the 4-gram match (not the latest 3-gram) wins.
    seq = [1, 7, 8, 9, 4, 0, 2, 7, 8, 9, 5, 0, 1, 7, 8, 9]
    tokens, n = ngram(seq).propose(2)
    assert (tokens, n) == ([4, 0], 4)


def test_ngram_first_occurrence_wins_at_equal_length():
    seq = [7, 8, 1, 3, 7, 8, 2, 3, 7, 8]
    assert ngram(seq, 2, 2).propose(1) == ([1], 2)


def test_ngram_matches_after_a_draft_that_is_not_indexed():
    # The sequence ends "... 4"; a draft [5, 6] makes "4 5 6", seen before the 7 8.
    seq = [1, 4, 5, 6, 7, 8, 9, 2, 4]
    index = ngram(seq, 1, 3)
    assert index.propose(3, [5, 6]) == ([7, 8, 9], 3)
    assert index.propose(2, [9]) == ([2, 4], 1)  # the draft's own last token: a 1-gram
    assert index.propose(2, [3]) == ([], 0)  # 3 never occurred
    # "1 4 2" then the draft "1 4": the copy after "1 4" runs through the draft, then on
    # through itself (period 3).
    assert ngram([1, 4, 2], 1, 2).propose(4, [1, 4]) == ([2, 1, 4, 2], 2)


def test_ngram_min_and_max():
    seq = [5, 6, 1, 9, 5, 6]  # only a 2-gram repeats
    assert ngram(seq, 2, 4).propose(3)[0] == [1, 9, 5]
    assert ngram(seq, 3, 4).propose(3) == ([], 0)  # below min: no match
    long = [1, 2, 3, 4, 5, 6, 0, 9, 1, 2, 3, 4, 5, 6]
    assert ngram(long, 2, 3).propose(1) == ([0], 3)  # the match is cut at max
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramIndex(4, 3)


def test_ngram_incremental_equals_built_at_once():
    rng = random.Random(0)
    seq = [rng.randrange(6) for _ in range(400)]
    grown = NgramIndex(2, 5)
    for i in range(0, len(seq), 7):
        grown.extend(seq[i : i + 7])
        once = ngram(seq[: i + 7], 2, 5)
        assert grown.propose(6) == once.propose(6)


def test_copy_after_continues_a_period():
    assert copy_after([1, 2, 3, 1, 2, 3, 1], 4, 6) == [2, 3, 1, 2, 3, 1]
    assert copy_after([4, 4], 1, 3) == [4, 4, 4]
    assert copy_after([1, 2], 1, 5, [3]) == [2, 3, 2, 3, 2]  # through the draft, then itself


# -- suffix -----------------------------------------------------------------------------


def test_trie_counts_and_removal():
    trie = SuffixTrie(3)
    trie.add([1, 2, 1, 2])
    assert trie.count[trie.find([1, 2], 0, 2)] == 2
    assert trie.count[trie.find([2, 1, 2], 0, 3)] == 1
    nodes = trie.nodes
    trie.add([1, 2, 1, 2])
    assert trie.nodes == nodes  # the same substrings: counts, not nodes
    trie.add([1, 2, 1, 2], -2)
    assert trie.nodes == 0 and trie.first[trie.root] == -1 and trie.total[trie.root] == 0


def paths(trie: SuffixTrie) -> dict[tuple[int, ...], tuple[int, int, int]]:
    """Every node as its substring -> (count, children's total, best child's token)."""
    out, stack = {}, [(trie.root, ())]
    while stack:
        node, path = stack.pop()
        best = trie.best[node]
        out[path] = (trie.count[node], trie.total[node], trie.token[best] if best >= 0 else -1)
        x = trie.first[node]
        while x >= 0:
            stack.append((x, (*path, trie.token[x])))
            x = trie.sibling[x]
    return out


def test_trie_eviction_keeps_counts_and_best_children():
    rng = random.Random(3)
    seqs = [[rng.randrange(4) for _ in range(30)] for _ in range(6)]
    trie = SuffixTrie(5)
    for seq in seqs:
        trie.add(seq)
    for seq in seqs[:3]:
        trie.add(seq, -1)
    rest = SuffixTrie(5)
    for seq in seqs[3:]:
        rest.add(seq)
    got, want = paths(trie), paths(rest)
    assert got.keys() == want.keys() and trie.nodes == rest.nodes
    for path, (count, total, _) in want.items():
        assert got[path][:2] == (count, total), path
        best = got[path][2]  # a best child: one of the highest count (ties either way)
        if best >= 0:
            assert want[(*path, best)][0] == max(
                c for p, (c, _, _) in want.items() if len(p) == len(path) + 1 and p[:-1] == path
            )


def test_grower_equals_trie_built_at_once():
    rng = random.Random(1)
    seq = [rng.randrange(5) for _ in range(300)]
    grower = Grower(6)
    for i in range(0, len(seq), 11):
        grower.extend(seq[i : i + 11])
    whole = SuffixTrie(6)
    whole.add(seq)
    assert grower.trie.nodes == whole.nodes
    assert paths(grower.trie) == paths(whole)


def test_suffix_draft_follows_the_most_frequent_continuation():
    p = SuffixParams(depth=8, max_match=4, spec_factor=4.0, min_prob=0.1)
    trie = SuffixTrie(8)
    trie.add([1, 2, 3, 4, 5, 6])
    trie.add([1, 2, 3, 4, 5, 6])
    trie.add([1, 2, 3, 9, 9, 9])
    got = draft(trie, [0, 1, 2, 3], 6, p)
    assert got.tokens[:3] == [4, 5, 6] and got.match_length == 3
    assert got.score == pytest.approx(3 * 2 / 3)  # each token: 2 of 3 continuations


def test_suffix_draft_length_follows_match_length_and_probability():
    trie = SuffixTrie(16)
    trie.add(list(range(1, 13)))
    p = SuffixParams(depth=16, max_match=8, spec_factor=1.0)
    assert len(draft(trie, [1, 2], 10, p).tokens) == 2  # ceil(2 x 1.0)
    assert len(draft(trie, [1, 2, 3, 4, 5], 10, p).tokens) == 5
    assert len(draft(trie, [1, 2, 3, 4, 5], 3, p).tokens) == 3  # the round's bound
    # Ten different continuations after [7, 7]: each has probability 0.1, below 0.2.
    wide = SuffixTrie(4)
    for t in range(10):
        wide.add([7, 7, 20 + t])
    assert draft(wide, [7, 7], 4, SuffixParams(depth=4, max_match=2, min_prob=0.2)).tokens == []
    assert draft(wide, [7, 7], 4, SuffixParams(depth=4, max_match=2, min_prob=0.1)).tokens


def test_suffix_draft_continues_past_the_trie_depth():
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12] * 2
    trie = SuffixTrie(6)
    trie.add(seq)
    got = draft(trie, seq[:10], 12, SuffixParams(depth=6, max_match=3, spec_factor=8.0))
    assert got.tokens == [11, 12, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]


def test_cache_bound_and_lru_eviction():
    cache = SuffixCache(10, SuffixParams(depth=4, max_match=3))
    cache.add("", [1, 2, 3, 4])
    cache.add("", [5, 6, 7, 8])
    assert cache.tokens == 8 and len(cache) == 2
    cache.add("", [1, 2, 3, 4])  # used again: most recent, counted twice
    assert cache.tokens == 8
    cache.add("", [9, 9, 9])  # 11 > 10: the least recently used ([5..8]) goes
    assert cache.tokens == 7 and len(cache) == 2
    assert cache.draft("", [5, 6], 2).tokens == []
    assert cache.draft("", [1, 2], 2).tokens == [3, 4]
    cache.add("", list(range(100, 130)))  # longer than the bound: its last 10 tokens
    assert cache.tokens == 10 and len(cache) == 1
    assert cache.draft("", [1, 2], 2).tokens == []
    assert cache.draft("", [121, 122], 2).tokens == [123, 124]
    assert cache.lookups == 4 and cache.hits == 2
    assert cache.tries[""].nodes > 0


def test_cache_tenants_are_isolated():
    cache = SuffixCache(100, SuffixParams(depth=4, max_match=3))
    cache.add("alice", [1, 2, 3, 4])
    assert cache.draft("alice", [1, 2], 2).tokens == [3, 4]
    assert cache.draft("bob", [1, 2], 2).tokens == []
    assert cache.draft("", [1, 2], 2).tokens == []


# -- predictions ------------------------------------------------------------------------


def test_prediction_follows_then_resyncs():
    pred = PredictionMatcher([10, 11, 12, 13, 14, 15, 16, 17])
    assert pred.propose([], 3) == [10, 11, 12]
    assert pred.propose([10, 11, 12, 13], 3) == [14, 15, 16]  # followed: continues
    # The output departs (99), then meets the prediction again at 15.
    assert pred.propose([10, 11, 12, 13, 99], 2) == []
    assert pred.propose([10, 11, 12, 13, 99, 15], 2) == [16, 17]
    assert pred.propose([10, 11, 12, 13, 99, 15, 16, 17], 2) == []  # its end


# -- the request's proposer -------------------------------------------------------------


def request_lookup(method, **kw):
    settings = LookupSettings(
        prompt_lookup_min=2,
        prompt_lookup_max=4,
        suffix=SuffixParams(depth=8, max_match=4, spec_factor=4.0),
    )
    return RequestLookup(method, settings, **kw)


PATTERN = [3, 1, 4, 1, 5, 9, 2, 6] * 3


def test_methods_and_sources():
    assert request_lookup(MODEL, output_from=len(PATTERN)).propose(PATTERN, 4) is None
    got = request_lookup(NGRAM, output_from=len(PATTERN)).propose(PATTERN, 4)
    assert got.source == NGRAM and got.tokens == [3, 1, 4, 1]
    got = request_lookup(SUFFIX, output_from=len(PATTERN)).propose(PATTERN, 4)
    assert got.source == SUFFIX and got.tokens == [3, 1, 4, 1]
    got = request_lookup(HYBRID, output_from=len(PATTERN)).propose(PATTERN, 4)
    assert got.source == NGRAM and got.tokens == [3, 1, 4, 1]
    # No repetition: hybrid falls back to the model (None), the lookups have nothing.
    fresh = list(range(40))
    for method in (NGRAM, SUFFIX, HYBRID):
        assert request_lookup(method, output_from=40).propose(fresh, 4) is None
    # A prediction comes first under every method, model included.
    got = request_lookup(MODEL, output_from=2, prediction=[7, 7, 8]).propose([1, 2], 4)
    assert got.source == PREDICTION and got.tokens == [7, 7, 8]


def test_hybrid_needs_a_confident_match():
    short = [5, 6, 0, 1, 2, 3, 5, 6]  # a 2-token match: not confident (3)
    assert request_lookup(SUFFIX, output_from=8).propose(short, 4) is not None
    assert request_lookup(HYBRID, output_from=8).propose(short, 4) is None
    three = [5, 6, 7, 0, 1, 2, 5, 6, 7]
    got = request_lookup(HYBRID, output_from=9).propose(three, 4)
    assert got.source == NGRAM and got.tokens == [0, 1, 2, 5]


def test_hybrid_takes_a_confident_cached_match_when_its_own_text_has_none():
    cache = SuffixCache(1000, SuffixParams(depth=8, max_match=4, spec_factor=4.0))
    cache.add("", [1, 2, 3, 4, 5, 6, 7, 8])
    got = request_lookup(HYBRID, output_from=0, cache=cache).propose([9, 2, 3, 4, 5], 3)
    assert got.source == SUFFIX and got.tokens == [6, 7, 8]
    # a 2-token cached match is not confident: the draft model drafts
    assert request_lookup(HYBRID, output_from=0, cache=cache).propose([9, 4, 5], 3) is None


def test_hybrid_extends_a_model_draft_only():
    ctx = [1, 2, 3, 4, 5, 6, 9, 1]
    hybrid = request_lookup(HYBRID, output_from=4)
    # The model drafted "2 3": "1 2 3" occurred, followed by "4 5 6".
    assert hybrid.extend(ctx, [2, 3], 3) == [4, 5, 6]
    assert hybrid.extend(ctx, [2, 3], 0) == []
    assert hybrid.extend(ctx, [], 3) == []  # no model draft: nothing to extend
    assert hybrid.extend(ctx, [7, 7], 3) == []  # "7 7" / "7" never occurred
    for method in (MODEL, NGRAM, SUFFIX):
        assert request_lookup(method, output_from=4).extend(ctx, [2, 3], 3) == []


@pytest.mark.parametrize("method", [NGRAM, SUFFIX, HYBRID])
def test_proposal_never_longer_than_k(method):
    lookup = request_lookup(method, output_from=0)
    assert lookup.propose(PATTERN, 0) is None
    for k in range(2, 10):  # (hybrid wants 2 tokens expected accepted)
        got = lookup.propose(PATTERN, k)
        assert got is not None and 1 <= len(got.tokens) <= k


def test_cache_fills_from_every_method_and_drafts_under_suffix():
    cache = SuffixCache(1000, SuffixParams(depth=8, max_match=4))
    request_lookup(MODEL, output_from=0, cache=cache).finish([1, 2, 3, 4, 5, 6, 7])
    got = request_lookup(SUFFIX, output_from=0, cache=cache).propose([9, 3, 4, 5], 3)
    assert got.tokens == [6, 7]
    assert request_lookup(NGRAM, output_from=0, cache=cache).propose([9, 3, 4, 5], 3) is None


def test_parse_method():
    assert parse_method(" Hybrid") == gateway_pb2.SPECULATION_METHOD_HYBRID
    with pytest.raises(ValueError, match="model, ngram, suffix, hybrid"):
        parse_method("eagle")


def test_a_seeded_request_drafts_from_its_own_text_only():
    cache = SuffixCache(1000, SuffixParams(depth=8, max_match=4))
    cache.add("", [1, 2, 3, 4, 5, 6, 7])
    own = request_lookup(SUFFIX, output_from=0, cache=cache, draft_from_cache=False)
    assert own.propose([9, 3, 4, 5], 3) is None
    own.finish([8, 8, 8])  # its output still fills the cache
    assert len(cache) == 2
