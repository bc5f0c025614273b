"""The drafter's dynamic tree with continued leaves (specdec.drafter.proposer.propose with
tree_depth): the tree's shape, each continuation token the drafter's own next token given
its path (greedy) or drawn from its distribution given its path, which it carries
(sampling), and the session's cache left as after a chain."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.common.params import SamplingParams
from specdec.common.prefix import prefix_hash
from specdec.drafter.proposer import DraftCall, propose
from specdec.drafter.speculate import BranchStore
from specdec.replica.engine import Prefix
from specdec.replica.sampling import decode_probs, warp
from tests.unit import test_speculate_refeed as refeed

CONTEXT, K = refeed.CONTEXT, refeed.K
drafter = refeed.drafter  # the drafter's runtime on the noisy tiny drafter (a fixture)


@pytest.fixture(scope="module")
def model(test_models):
    return AutoModelForCausalLM.from_pretrained(test_models.draft_noisy, dtype=torch.float32)


def _logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1].float()


def _path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def _draft(rt, session: str, params: SamplingParams, nodes: int, depth: int):
    return rt.drive(
        propose(
            DraftCall(
                rt,
                BranchStore(),
                session,
                Prefix(0, prefix_hash([])),
                CONTEXT,
                K,
                params,
                tree_nodes=nodes,
                tree_width=3,
                tree_depth=depth,
            )
        )
    )


def _shape(draft, nodes: int, depth: int) -> list[int]:
    """Checks the tree's layout; the continuation nodes."""
    parents = draft.parents
    assert len(draft.tokens) == len(parents) == K + nodes
    assert parents[:K] == [-1, 0, 1, 2]
    leaves = [i for i in range(K, len(parents)) if parents[i] < K]
    below = [i for i in range(K, len(parents)) if parents[i] >= K]
    assert leaves == list(range(K, K + len(leaves)))  # leaves first, then continuations
    rows = nodes // (1 + depth)
    assert len(below) == rows * depth and len(leaves) == nodes - rows * depth
    for i in below:
        assert parents[i] < i
    return below


def test_greedy_continuations_are_the_drafters_next_tokens(drafter, model):
    draft = _draft(drafter, "greedy", SamplingParams(), 7, 2)
    below = _shape(draft, 7, 2)
    assert draft.cached_length == len(CONTEXT) + K - 1  # as after a chain
    for i in range(len(draft.tokens)):
        if i in below or i < K:
            path = _path(draft.tokens, draft.parents, i)
            before = CONTEXT + path[:-1]
            assert int(_logits(model, before).argmax()) == path[-1], i


def test_sampled_continuations_carry_their_distribution(drafter, model):
    params = SamplingParams(temperature=1.0, seed=5)
    draft = _draft(drafter, "sampled", params, 6, 2)
    below = _shape(draft, 6, 2)
    vocab = drafter.vocab_size
    for i in below:
        path = _path(draft.tokens, draft.parents, i)
        q = decode_probs(draft.probs[i], vocab)
        expected = warp(_logits(model, CONTEXT + path[:-1])[None], params)[0]
        assert q[path[-1]] > 0
        torch.testing.assert_close(q, expected, atol=2e-3, rtol=0)
    for i in range(K, len(draft.tokens)):
        if i not in below:  # a leaf: chosen, one-hot
            assert float(decode_probs(draft.probs[i], vocab)[draft.tokens[i]]) == 1.0


@pytest.mark.parametrize(
    ("nodes", "width", "depth", "message"),
    [
        (0, 0, 2, "tree_depth needs tree_nodes"),
        (2, 3, 2, "tree_nodes must be at least 1 + tree_depth"),
        (6, 1, 2, "tree_width must be in [2, 8]"),
    ],
)
def test_draft_tree_arguments_are_checked(drafter, nodes, width, depth, message):
    from specdec.common.errors import InvalidRequest
    from specdec.drafter.server import DrafterServicer
    from specdec.v1 import common_pb2, drafter_pb2

    request = drafter_pb2.DraftRequest(
        session_id="checked",
        prefix=common_pb2.CachedPrefix(),
        new_tokens=CONTEXT,
        num_draft_tokens=K,
        tree_nodes=nodes,
        tree_width=width,
        tree_depth=depth,
    )
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        DrafterServicer(drafter).draft_call(request)
