"""Token trees through the stack (gateway --tree-width, VerifyRequest.draft_parents): greedy
equals generate() for trees from every lookup source and the drafter's dynamic trees (whose
best leaves the fixed policy continues), with and without SSD; sampled sequences follow the target's distribution with trees of width >= 2
from the cache of outputs and from the drafter (the rule's negative controls, siblings
checked against p instead of the residual and leaves labelled with q, are
tests/unit/test_tree_rule.py's, on the same chi-square)."""

from __future__ import annotations

import pytest

from specdec.sdk import Client
from tests.conftest import PROMPTS
from tests.integration.test_gateway import small_stack
from tests.integration.test_lookup import GROUNDED, LOOKUP_METHODS
from tests.integration.test_ssd import check_sequence_counts, exact_sequence_probs, sample_top2

pytestmark = pytest.mark.integration

N = 48


@pytest.fixture(scope="module")
def tree_stack(test_models):
    """One verifier, one drafter, gateways verifying trees of up to 4 branches: `own`
    (lookups over the request's own text), `ssd` (SSD on, the global cache of outputs)."""
    trees = ("--tree-width", "4", "--k-policy", "fixed")
    with small_stack(
        test_models.draft_noisy,
        test_models.target,
        gateway_flags=(*trees, "--suffix-cache-scope", "off"),
        more_gateways={"ssd": (*trees, "--ssd")},
    ) as procs:
        yield {"own": procs["gateway"].address, "ssd": procs["ssd"].address}


@pytest.mark.parametrize("ssd", [False, True], ids=["plain", "ssd"])
@pytest.mark.parametrize("method", [*LOOKUP_METHODS, "model"])
def test_greedy_trees_equal_generate(tree_stack, tokenizer, reference, method, ssd):
    """Trees from the n-gram index, the suffix tries, hybrid's lookups and the drafter's
    top alternatives give generate()'s tokens, with SSD on the model rounds too; trees were
    verified, and some round's path took another branch than the draft's own (a round a
    chain would have lost)."""
    results = []
    with Client(tree_stack["own"], timeout=300) as client:
        info = client.server_info()
        assert info.lookup["tree_width"] == 4 and info.lookup["max_tree_width"] == 8
        for text in [*GROUNDED, *PROMPTS[:2]]:
            ids = tokenizer(text).input_ids
            got = client.generate(token_ids=ids, max_new_tokens=N, k=6, method=method, ssd=ssd)
            assert list(got.tokens) == reference(ids, N), (method, text)
            assert got.stats.cache_misses == 0
            results.append(got)
    assert sum(r.stats.tree_rounds for r in results) > 0
    assert sum(r.stats.tree_nodes for r in results) > sum(r.stats.tree_rounds for r in results)
    if method != "hybrid":  # hybrid's lookups here are confident matches, rarely branched
        assert sum(r.stats.tree_other_branch_rounds for r in results) > 0
    if method == "model":  # k = 6 and 9 nodes: 3 leaves continued by 2 (terminal: 3 nodes)
        assert sum(r.stats.tree_nodes for r in results) > 10 * sum(
            r.stats.tree_rounds for r in results
        )


def test_sampling_distribution_with_suffix_trees(tree_stack, tokenizer, target_model):
    """Sampled through the stack with trees of 2+ branches from the cache of outputs
    (one-hot q per node): all 16 sequences of 4 tokens (top-k 2) within 5 sigma, with
    check_sequence_counts' own negative control."""
    ids = tokenizer(PROMPTS[1]).input_ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    with Client(tree_stack["ssd"], timeout=300) as client:  # fill the cache: both first tokens
        for seq in exact:
            client.generate(token_ids=[*ids, *seq[:2]], max_new_tokens=3, k=0)
    results = sample_top2(tree_stack["ssd"], ids, 1200, k=3, method="suffix")
    trees = sum(r.stats.tree_rounds for r in results)
    other = sum(r.stats.tree_other_branch_rounds for r in results)
    assert trees > 600 and other > 100, (trees, other)
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


@pytest.mark.parametrize("ssd", [False, True], ids=["plain", "ssd"])
def test_greedy_prediction_grafted_on_model_drafts(tree_stack, tokenizer, reference, ssd):
    """A prediction with edits (the expected output with tokens changed) grafted onto the
    model's drafts as one tree gives generate()'s tokens; some round's path took the
    prediction's branch where it departed from the model's draft, or the model's where the
    prediction was wrong."""
    results = []
    with Client(tree_stack["own"], timeout=300) as client:
        for text in PROMPTS[:2]:
            ids = tokenizer(text).input_ids
            expected = reference(ids, N)
            edited = [*expected[:10], 7, 8, *expected[12:30], 9, *expected[31:]]
            got = client.generate(
                token_ids=ids, max_new_tokens=N, k=4, method="model", ssd=ssd, prediction=edited
            )
            assert list(got.tokens) == expected, text
            results.append(got)
    assert sum(r.stats.tree_rounds for r in results) > 0
    assert sum(r.stats.tree_other_branch_rounds for r in results) > 0


def test_sampling_distribution_with_drafter_trees(tree_stack, tokenizer, target_model):
    """Sampled through the stack with the drafter's dynamic trees (its draft tokens with q,
    its top alternatives as one-hot leaves), a prediction (the likeliest sequence) grafted
    on where it proposes, and SSD on their first branch: all 16 sequences of 4 tokens
    (top-k 2) within 5 sigma, with check_sequence_counts' negative control."""
    ids = tokenizer(PROMPTS[2]).input_ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    likeliest = list(max(exact, key=exact.get))
    results = sample_top2(tree_stack["ssd"], ids, 1200, k=3, method="model", prediction=likeliest)
    trees = sum(r.stats.tree_rounds for r in results)
    other = sum(r.stats.tree_other_branch_rounds for r in results)
    assert trees > 600 and other > 50, (trees, other)
    check_sequence_counts([tuple(r.tokens) for r in results], exact)


def test_sampling_distribution_with_continued_drafter_trees(tree_stack, tokenizer, target_model):
    """Sampled through the stack with the drafter's trees whose leaves continue (k = 3,
    width 4, the fixed policy: 3 leaves continued by 1 drawn token, each with the
    distribution it was drawn from): all 16 sequences of 4 tokens (top-k 2) within 5 sigma,
    with check_sequence_counts' negative control. Under top-k 2 each position has one
    alternative, so terminal leaves would make at most 6 nodes a round."""
    ids = tokenizer(PROMPTS[2]).input_ids
    exact = exact_sequence_probs(target_model, ids, steps=4, top_k=2)
    results = sample_top2(tree_stack["own"], ids, 1200, k=3, method="model")
    trees = sum(r.stats.tree_rounds for r in results)
    nodes = sum(r.stats.tree_nodes for r in results)
    other = sum(r.stats.tree_other_branch_rounds for r in results)
    assert trees > 600 and nodes > 7 * trees and other > 50, (trees, nodes, other)
    check_sequence_counts([tuple(r.tokens) for r in results], exact)
