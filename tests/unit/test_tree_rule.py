"""The token-tree rule (specdec.replica.sampling.tree_verdict): greedy tables, and the
first two sampled tokens' joint distribution against the target's, by chi-square, with a
negative control (siblings checked against p instead of the residual) that must fail; the
same for the drafter's dynamic trees (specdec.drafter.proposer.plan), whose negative
control labels its one-hot leaves with q."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.drafter.proposer import plan
from specdec.replica import sampling
from specdec.replica.sampling import sample_from, tree_children, tree_verdict

VOCAB = 6
START = 0
Z_CHI2 = 4.0  # one-sided, about 3e-5 false alarms per run


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _one_hot(token: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float()


def test_children_in_node_order():
    assert tree_children([-1, -1, 0, 1, 0]) == [[0, 1], [2, 4], [3], [], [], []]


def _greedy_rows(argmaxes: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmaxes), VOCAB).float()


@pytest.mark.parametrize(
    "tokens, parents, argmaxes, path, next_token",
    [
        # root's argmax 3: the second branch; then node 1's argmax 4: its child node 3
        ([2, 3, 5, 4], [-1, -1, 0, 1], [3, 5, 4, 1, 0], [1, 3], 0),
        # the first branch all the way, then the bonus
        ([2, 3, 5, 4], [-1, -1, 0, 1], [2, 5, 1, 1, 0], [0, 2], 1),
        # nothing matches at the root
        ([2, 3], [-1, -1], [1, 0, 0], [], 1),
        # a chain as a tree
        ([1, 2, 3], [-1, 0, 1], [1, 2, 0, 5], [0, 1], 0),
        # duplicate siblings: the first one wins
        ([4, 4], [-1, -1], [4, 2, 3], [0], 2),
        # the empty tree
        ([], [], [3], [], 3),
    ],
)
def test_greedy_longest_argmax_path(tokens, parents, argmaxes, path, next_token):
    got = tree_verdict(tokens, parents, _greedy_rows(argmaxes), None, None, greedy=True)
    assert got == (path, next_token)


def _target() -> torch.Tensor:
    """A bigram target p(x | prev) [V, V], every entry positive."""
    g = torch.Generator().manual_seed(7)
    return torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 1.5, dim=-1)


def _drafter() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.softmax(torch.randn(VOCAB, VOCAB, generator=g) * 1.5, dim=-1)


def _first_two(tokens, parents, rows, probs, target, g) -> torch.Tensor:
    """One run of the rule: the first two emitted tokens. A run that emits one token takes
    its second from the target (the next round's first token is the target's, whatever
    that round drafts)."""
    path, nxt = tree_verdict(tokens, parents, rows, probs, g, greedy=False)
    emitted = [tokens[j] for j in path] + [nxt]
    if len(emitted) == 1:
        emitted.append(int(sample_from(target[emitted[0]], g)))
    return torch.tensor(emitted[:2])


def _two_tokens(n: int, seed: int) -> torch.Tensor:
    """n runs of the rule on one tree after START; the first two emitted tokens [n, 2].

    The tree: two lookup branches (one-hot 2 then its one-hot child 4; one-hot 3), then a
    model node drawn from the drafter, its own model child drawn after it."""
    target, drafter = _target(), _drafter()
    g = _gen(seed)
    out = torch.empty(n, 2, dtype=torch.long)
    parents = [-1, 0, -1, -1, 3]
    for i in range(n):
        model = int(sample_from(drafter[START], g))
        model_child = int(sample_from(drafter[model], g))
        tokens = [2, 4, 3, model, model_child]
        probs = torch.stack([_one_hot(2), _one_hot(4), _one_hot(3), drafter[START], drafter[model]])
        rows = torch.stack([target[START], *(target[t] for t in tokens)])  # [k+1, V]
        out[i] = _first_two(tokens, parents, rows, probs, target, g)
    return out


def chi_square_failure(counts: torch.Tensor, exact: torch.Tensor) -> str | None:
    """The chi-square test of counts against exact probabilities (same shape), with the
    Wilson-Hilferty bound at Z_CHI2; a message when it fails, else None."""
    n = int(counts.sum())
    positive = exact > 0
    if (counts[~positive] > 0).any():
        return "a token pair of probability 0 was emitted"
    expected = n * exact[positive].double()
    chi2 = float(((counts[positive].double() - expected) ** 2 / expected).sum())
    df = int(positive.sum()) - 1
    a = 2.0 / (9 * df)
    bound = df * (1 - a + Z_CHI2 * math.sqrt(a)) ** 3
    return f"chi-square {chi2:.1f} > {bound:.1f} (df {df})" if chi2 > bound else None


def _pair_counts(pairs: torch.Tensor) -> torch.Tensor:
    return torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB**2).reshape(
        VOCAB, VOCAB
    )


def _exact_pairs() -> torch.Tensor:
    t = _target().double()
    return t[START][:, None] * t


N = 12_000


def test_sampled_tree_is_exact():
    assert chi_square_failure(_pair_counts(_two_tokens(N, 0)), _exact_pairs()) is None


def test_negative_control_siblings_against_p_is_rejected(monkeypatch):
    """The same tree and test with each sibling checked against p itself (no residual):
    the chi-square test must catch it, or the test above could not fail."""
    monkeypatch.setattr(sampling, "_residual", lambda p, q: p)
    assert chi_square_failure(_pair_counts(_two_tokens(N, 0)), _exact_pairs()) is not None


def test_sampled_zero_probability_node_is_rejected():
    """A node whose proposal gives its token no mass cannot have been drawn: rejected."""
    target = torch.full((2, VOCAB), 1.0 / VOCAB)
    probs = _one_hot(1)[None]
    for seed in range(20):
        path, _ = tree_verdict([2], [-1], target, probs, _gen(seed), greedy=False)
        assert path == []


def _drafter_tree_tokens(
    n: int, seed: int, leaf_q: bool = False, depth: int = 0, continuation_row: bool = False
) -> torch.Tensor:
    """n runs of the rule on the drafter's dynamic tree after START (specdec.drafter.
    proposer.plan): a draft of 2 tokens drawn from the drafter, then 3 + depth nodes: the
    drafter's top alternatives to them as leaves, each one-hot (leaf_q: each labelled with the draft
    token's distribution q instead, the negative control), the best continued by `depth`
    tokens drawn from the drafter after it, each labelled with the distribution it was drawn
    from (continuation_row: with the row its leaf was chosen from instead, the drafter's
    distribution before the leaf, a negative control); the first two emitted tokens. With
    depth, the drafter is closer to the target: a one-hot leaf after a drawn sibling is
    checked against the residual max(0, p - q), which is 0 wherever the drafter puts more
    mass than the target, so a drafter far from it never reaches a continuation."""
    target, drafter = _target(), _drafter()
    if depth:  # a drafter closer to the target: its alternatives survive the residual
        drafter = 0.6 * target + 0.4 * drafter
    g = _gen(seed)
    out = torch.empty(n, 2, dtype=torch.long)
    top = torch.topk(drafter, 3, dim=-1)

    def tree(d1: int, d2: int):  # the tree and its rows for a draft: a function of the draws
        conf = [float(drafter[START, d1]), float(drafter[d1, d2])]
        alts = [top.indices[START].tolist(), top.indices[d1].tolist()]
        alt_p = [top.values[START].tolist(), top.values[d1].tolist()]
        leaves, parents, continued = plan([d1, d2], conf, alts, alt_p, 3 + depth, 3, depth)
        tokens = [d1, d2, *leaves]
        rows_q = {-1: drafter[START], 0: drafter[d1]}  # a node's parent -> q of its children
        probs = [drafter[START], drafter[d1]]
        probs += [rows_q[parents[j]] if leaf_q else _one_hot(t) for j, t in enumerate(leaves, 2)]
        return tokens, parents, probs, continued

    trees = {(a, b): tree(a, b) for a in range(VOCAB) for b in range(VOCAB)}
    for i in range(n):
        d1 = int(sample_from(drafter[START], g))
        d2 = int(sample_from(drafter[d1], g))
        tokens, parents, probs, continued = trees[(d1, d2)]
        tokens, parents, probs = list(tokens), list(parents), list(probs)
        for leaf in continued:  # drawn after the leaf, from the drafter given its path
            last = leaf
            for _ in range(depth):
                q = drafter[tokens[last]]
                tokens.append(int(sample_from(q, g)))
                before = parents[last]  # the row the leaf (or node) was drawn or chosen from
                probs.append(
                    (drafter[START] if before == -1 else drafter[tokens[before]])
                    if continuation_row
                    else q
                )
                parents.append(last)
                last = len(tokens) - 1
        rows = torch.stack([target[START], *(target[t] for t in tokens)])
        out[i] = _first_two(tokens, parents, rows, torch.stack(probs), target, g)
    return out


@pytest.mark.parametrize("depth", [0, 1], ids=["terminal", "continued"])
def test_drafter_tree_is_exact(depth):
    """The drafter's dynamic tree (sampled draft tokens with q, their top alternatives as
    one-hot leaves chosen from the draws, the best continued by a token drawn after it
    with its q) emits the target's joint."""
    pairs = _drafter_tree_tokens(N, 1, depth=depth)
    assert chi_square_failure(_pair_counts(pairs), _exact_pairs()) is None


def test_negative_control_drafter_leaves_labelled_q_is_rejected():
    """The same tree with each leaf claiming the draft token's q (it was chosen, not drawn
    from it): the chi-square test catches it."""
    pairs = _drafter_tree_tokens(N, 1, leaf_q=True)
    assert chi_square_failure(_pair_counts(pairs), _exact_pairs()) is not None


def test_negative_control_continuation_labelled_with_the_wrong_row_is_rejected():
    """A continuation token labelled with the drafter's row before its leaf (the one the
    leaf was chosen from) instead of the one after it, which it was drawn from: the
    chi-square test catches it."""
    pairs = _drafter_tree_tokens(N, 1, depth=1, continuation_row=True)
    assert chi_square_failure(_pair_counts(pairs), _exact_pairs()) is not None


def test_plan_continues_the_best_leaves():
    """Each continued leaf costs 1 + depth nodes of the budget: the best leaves by path
    probability are continued, what is left buys the next best as terminal leaves; no
    continuation without depth or where the rows' bound allows none."""
    alts = [[5, 1, 2], [3, 4, 0], [1, 2, 3]]
    probs = [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.4, 0.35, 0.25]]
    # draft 1, 3, 2; scores: pos0 5:0.5 2:0.2; pos1 4:0.09 0:0.03; pos2 1:0.072 3:0.045
    leaves, parents, continued = plan([1, 3, 2], [0.3, 0.6, 0.35], alts, probs, 7, 3, 2)
    # two leaves continued by 2 (6 nodes), one terminal: 5 and 2 continued, 4 terminal
    assert leaves == [5, 2, 4] and parents == [-1, 0, 1, -1, -1, 0]
    assert continued == [3, 4]
    assert plan([1, 3, 2], [0.3, 0.6, 0.35], alts, probs, 5, 3, 2) == (
        [5, 2, 4],
        [-1, 0, 1, -1, -1, 0],
        [3],
    )
    assert plan([1, 3, 2], [0.3, 0.6, 0.35], alts, probs, 3, 3, 2, max_rows=0)[2] == []
    assert plan([1, 3, 2], [0.3, 0.6, 0.35], alts, probs, 3, 3)[2] == []


def test_grow_keeps_the_likeliest_paths():
    """Leaves are scored by their path probability under the drafter: a sure first token
    puts them later; at most width - 1 per position, never the draft token itself."""
    alts = [[5, 1, 2], [3, 4, 0], [1, 2, 3]]
    probs = [[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.4, 0.35, 0.25]]
    # draft 1, 3, 2: confidences 0.3, 0.6, 0.35
    leaves, parents, _ = plan([1, 3, 2], [0.3, 0.6, 0.35], alts, probs, 3, 3)
    # scores: pos0 5:0.5 2:0.2; pos1 4:0.09 0:0.03; pos2 1:0.072 3:0.045
    assert leaves == [5, 2, 4] and parents == [-1, 0, 1, -1, -1, 0]
    leaves, parents, _ = plan([5, 3, 1], [0.5, 0.6, 0.4], alts, probs, 2, 2)
    # width 2: one alternative per position: pos0 1:0.3, pos1 4:0.15, pos2 2:0.105
    assert leaves == [1, 4] and parents == [-1, 0, 1, -1, 0]
    assert plan([5], [1.0], [[5, 1]], [[1.0, 0.0]], 4, 2) == ([], [], [])
