"""Lookup candidates as token trees: merging, the n-gram index's and the suffix tries'
other candidates, and the policy's sizing of a tree against its cost curve."""

from __future__ import annotations

from types import SimpleNamespace

from specdec.common.cost import Line, ReportedCost
from specdec.gateway.round.lookup.ngram import NgramIndex
from specdec.gateway.round.lookup.settings import SuffixParams
from specdec.gateway.round.lookup.suffix import SuffixTrie, branches
from specdec.gateway.round.policy import AdaptivePolicy, FixedPolicy
from specdec.gateway.round.ssd import through_leaf
from specdec.gateway.round.tree import DraftTree
from specdec.v1 import drafter_pb2, verifier_pb2


def test_merge_shares_prefixes_and_keeps_the_first_branch_first():
    tree = DraftTree.merge([[1, 2, 3], [1, 2, 4], [5, 6]], budget=10)
    assert tree.tokens == (1, 2, 3, 4, 5, 6)
    assert tree.parents == (-1, 0, 1, 1, -1, 4)
    assert tree.chain == 3 and tree.first_branch == (1, 2, 3) and tree.width == 2
    assert DraftTree.merge([[1, 2, 3], [5, 6]], budget=4) == DraftTree(
        (1, 2, 3, 5), (-1, 0, 1, -1), 3
    )
    assert DraftTree.merge([[1, 2], [1, 2]], budget=4).is_chain


def test_ngram_candidates_start_with_different_tokens():
    index = NgramIndex(1, 3, width=3)
    # "0 1 2" is followed by 11 first, then by 10
    index.extend([1, 2, 10, 0, 1, 2, 11, 0, 1, 2, 10, 0, 1, 2])
    assert index.propose(3)[0] == [11, 0, 1]  # the first occurrence: the chain's draft
    assert index.candidates(3, 3) == [[11, 0, 1], [10, 0, 1]]
    assert index.candidates(3, 1) == [[11, 0, 1]]
    assert NgramIndex(1, 3).candidates(3, 3) == []  # empty index
    # width 1 keeps no later occurrences: the other candidate is a shorter n-gram's first
    single = NgramIndex(1, 3)
    single.extend([1, 2, 10, 0, 1, 2, 11, 0, 1, 2])
    assert single.candidates(2, 3) == [[11, 0], [10, 0]]


def test_suffix_branches_follow_the_most_frequent_continuations():
    trie = SuffixTrie(8)
    for seq in ([7, 8, 1, 2], [7, 8, 1, 2], [7, 8, 3, 4]):
        trie.add(seq)
    params = SuffixParams(depth=8, max_match=4, spec_factor=2.0, min_prob=0.1)
    found = branches(trie, [5, 7, 8], 2, params, 3)
    assert [d.tokens for d in found] == [[1, 2], [3, 4]]
    assert found[0].score > found[1].score
    assert [d.tokens for d in branches(trie, [5, 7, 8], 2, params, 1)] == [[1, 2]]


def test_fixed_policy_gives_other_branches_a_share():
    assert FixedPolicy().tree_sizes(8, 1, 16) == (8, 4)
    assert FixedPolicy().tree_sizes(16, 3, 16) == (10, 2)


def _adaptive(per_token_ms: float) -> AdaptivePolicy:
    policy = AdaptivePolicy(ssd=False, max_fan_out=1)
    verifier = ReportedCost(((1, Line(10.0, per_token_ms, 20.0, 32)),))  # its cost curve
    policy.bind(None, SimpleNamespace(replica=SimpleNamespace(cost=verifier)))
    for _ in range(50):  # a source whose first token is often wrong, other branches good
        policy.sources["ngram"].observe(8, 0)
        policy.sources["ngram"].observe(8, 8)
        policy.alternatives.observe(4, 4)
    return policy


def test_adaptive_tree_on_a_flat_curve_chain_on_a_steep_one():
    """Memory-bound verification (a node costs little): a tree; compute-bound (a node
    costs as much as the round's fixed part): a chain."""
    chain, share = _adaptive(0.05).tree_sizes(8, 2, 16, "ngram")
    assert share > 0 and chain + 2 * share <= 16
    assert _adaptive(10.0).tree_sizes(8, 2, 16, "ngram")[1] == 0


def test_bench_rows_with_trees_beside_their_chains():
    from specdec.tools.bench.modes import build_modes

    modes = {m.name: m for m in build_modes([8], [4], methods=("ngram",), tree_width=3)}
    for name in ("ngram tree3 k=8", "ssd ngram tree3 k=4", "ngram tree3 adaptive k<=8"):
        assert modes[name].tree_width == 3 and modes[name].method == "ngram", name
    assert modes["ngram k=8"].tree_width is None  # the chain it is compared with
    for name in ("tree3 k=8", "ssd tree3 k=4", "tree3 adaptive k<=8"):
        assert modes[name].tree_width == 3 and modes[name].method == "model", name
    assert not any("tree" in m for m in {m.name for m in build_modes([8], [4], methods=("ngram",))})


def test_model_tree_fixed_and_priced():
    """The drafter's tree: the fixed policy's width - 1 leaves continued by half the draft
    (shortened to the bound, terminal leaves where no continuation fits); the adaptive
    one's by the cost curves: continued leaves on a flat verify curve with a cheap drafter
    forward, terminal ones with a costly drafter forward, a chain on a steep curve."""
    assert FixedPolicy().model_tree(8, 3, 16) == (10, 4)
    assert FixedPolicy().model_tree(4, 3, 12) == (6, 2)
    assert FixedPolicy().model_tree(2, 4, 16) == (6, 1)
    assert FixedPolicy().model_tree(8, 3, 8) == (8, 3)
    assert FixedPolicy().model_tree(8, 3, 2) == (2, 0)
    assert FixedPolicy().model_tree(8, 1, 16) == (0, 0)
    flat, steep, slow_drafter = _adaptive(0.05), _adaptive(10.0), _adaptive(0.05)
    # leaves taken: in every other round of 5 leaves; in one round of ten
    for policy, draft_ms, g in ((flat, 0.1, 0.1), (steep, 0.1, 0.1), (slow_drafter, 40.0, 0.02)):
        for _ in range(20):
            policy.leaves.add(g)
            policy.observe_draft(6, 0.001 + 6 * draft_ms / 1e3, forward_ms=6 * draft_ms)
            policy.model.observe(6, 4)
    nodes, depth = flat.model_tree(6, 3, 10)
    assert depth > 0 and 1 + depth <= nodes <= 10
    nodes, depth = slow_drafter.model_tree(6, 3, 10)
    assert depth == 0 and 0 < nodes <= 10
    assert steep.model_tree(6, 3, 10) == (0, 0)


def test_on_chain_and_branch_of_a_drafter_tree():
    tree = DraftTree((5, 6, 7, 8, 9), (-1, 0, 1, -1, 0), 3)  # a draft of 3, two leaves
    assert tree.on_chain([0, 1, 2]) == 3 and tree.branch([0, 1, 2]) == 0
    assert tree.on_chain([0, 4]) == 1 and tree.branch([0, 4]) == 1
    assert tree.on_chain([3]) == 0 and tree.branch([3]) == 1
    assert tree.branch([]) is None
    assert tree.leaves() == (2, 0)
    assert tree.path_first([0, 4]) == (5, 9, 6, 7, 8)
    lookup = DraftTree((5, 6, 7, 8), (-1, 0, 1, -1), 3)  # the second root branch is 1
    assert lookup.branch([3]) == 1 and lookup.branch([0, 1]) == 0
    chain = DraftTree((5, 6, 7))
    assert chain.on_chain([0, 1]) == 0 and chain.branch([0, 1]) == 0 and chain.width == 1
    assert chain.accepted_on_chain(2, [0, 1]) == 2 and tree.accepted_on_chain(2, [0, 4]) == 1


def test_graft_shares_the_path_it_spells():
    tree = DraftTree((5, 6, 7, 9), (-1, 0, 1, 0), 3)  # a draft 5 6 7 and a leaf 9 beside 6
    tree = tree.graft([5, 9, 4, 4], 16)  # 5 and 9 shared, then 4 4
    assert tree.tokens == (5, 6, 7, 9, 4, 4) and tree.parents == (-1, 0, 1, 0, 3, 4)
    assert tree.chain == 3 and tree.leaves() == (1, 2)
    tree = tree.graft([8, 1], 7)  # the budget cuts it
    assert tree.tokens[-1] == 8 and tree.parents[-1] == -1 and len(tree.tokens) == 7
    assert tree.graft([5, 6, 7], 16) == tree
    # onto a chain: the chain is the first branch; a graft that continues it, a chain
    grafted = DraftTree((5, 6)).graft([5, 7], 16)
    assert grafted == DraftTree((5, 6, 7), (-1, 0, 0), 2)
    assert DraftTree((5, 6)).graft([5, 6, 1], 16) == DraftTree((5, 6, 1))


def test_ssd_branch_through_a_leaf():
    """Greedy SSD after a drafter tree: a path through one leaf x, then y, uses the branch
    prepared for "on-chain tokens, then x" when its draft starts with y."""
    draft = DraftTree((5, 6, 7, 9), (-1, 0, 1, 0), chain=3)  # leaf 9 by 6
    branch = drafter_pb2.SpeculatedBranch(accepted_count=1, next_token=9, draft_tokens=[4, 2, 3])
    other = drafter_pb2.SpeculatedBranch(accepted_count=1, next_token=6, draft_tokens=[4, 1])
    response = drafter_pb2.SpeculateResponse(branches=[other, branch])
    verdict = verifier_pb2.VerifyResponse(accepted_count=2, next_token=4, accepted_path=[0, 3])
    assert through_leaf(response, verdict, draft, 1) == branch
    verdict.next_token = 8  # the branch drafted 4 after the leaf: no use
    assert through_leaf(response, verdict, draft, 1) is None
    deeper = verifier_pb2.VerifyResponse(accepted_count=3, next_token=4, accepted_path=[0, 3, 2])
    assert through_leaf(response, deeper, draft, 1) is None
    # the leaf continued by 4 (node 4): a path through it then 2 uses the branch's rest
    # (3, 5: as long as after a terminal leaf), never a shorter one
    continued = DraftTree((5, 6, 7, 9, 4), (-1, 0, 1, 0, 3), chain=3)
    through = verifier_pb2.VerifyResponse(accepted_count=3, next_token=2, accepted_path=[0, 3, 4])
    assert through_leaf(response, through, continued, 1) is None  # rest: 3 only
    longer = drafter_pb2.SpeculatedBranch(accepted_count=1, next_token=9, draft_tokens=[4, 2, 3, 5])
    response = drafter_pb2.SpeculateResponse(branches=[other, longer])
    assert through_leaf(response, through, continued, 1) == longer
    through.next_token = 3  # the branch drafted 2 after the continuation: no use
    assert through_leaf(response, through, continued, 1) is None
