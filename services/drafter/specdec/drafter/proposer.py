"""The drafter's domain logic: propose k tokens and the distributions they came from.

`propose` is a model-thread job (specdec.replica.batching): each of its k forwards is batched
with the forwards of other sessions drafting at the same time (lock-step).

A Draft may ask for a dynamic token tree (DraftRequest.tree_nodes): the draft as drawn,
then up to tree_nodes leaves, each one of the drafter's top alternatives to a draft token,
a sibling of it (`plan`). The alternatives come from the rows the draft was drawn from. A
leaf's path probability under the drafter is the product of the draft tokens' probabilities
before it times its own; the leaves with the highest are kept, which puts them where the
drafter is unsure, early. Each leaf is a deterministic function of the drawn tokens, so its
proposal is one-hot; the draft token keeps the distribution it was drawn from and comes
first among its siblings (docs/concepts/trees.md: exact under the tree rule).

With DraftRequest.tree_depth > 0 the best leaves continue: each is a row of a BranchGroup
over the session's cache (the SSD branch rows of specdec.drafter.speculate: the row sees the
draft up to the leaf's parent, then its own tokens, in its own keys and values), and
tree_depth more forwards, batched over the rows, draw each row's next token from the
drafter's distribution given its path (`continue_leaves`). Those tokens are drawn (from a
stream of their own under a seed), so each carries the distribution it was drawn from.
Every node counts in tree_nodes (`plan`). The session's cache gains none of it: after a
Draft it holds the prefix, the new tokens and d_1..d_{k-1}, as for a chain."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.common.controls import Controls
from specdec.drafter.config import DrafterConfig
from specdec.drafter.sampler import TREE_SALT, Sampler, sampler_for
from specdec.drafter.speculate import (
    BranchStore,
    DraftRows,
    branch_budget,
    draft_branches,
    take_prepared,
)
from specdec.replica.batching import ModelRequest
from specdec.replica.engine import CachedSession, Engine, Prefix
from specdec.replica.host import to_host
from specdec.replica.processors import TokenCounts
from specdec.replica.sampling import EncodedProbs, SamplingParams, encoded_rows, one_hot_encoded


@dataclass
class DraftResult:
    tokens: list[int]  # [k]
    probs: list[EncodedProbs]  # [k], empty when greedy
    cached_length: int
    forward_ms: float
    prepared: bool = False  # served from a Speculate branch, no forward
    parents: list[int] = field(default_factory=list)  # a tree's (DraftResponse.draft_parents)


@dataclass(frozen=True)
class DraftCall:
    """A validated Draft, what `propose` drafts: k tokens after prefix + new_tokens of the
    session, each step under params and the request's logits processors (controls).
    fork_from: start the session as a copy of that session's cache (SessionStore.acquire).
    tree_nodes > 0: the draft grows into a tree of up to tree_nodes more nodes, at most
    tree_width children per node (`plan`), the best leaves continued by tree_depth drawn
    tokens (`continue_leaves`). branches: the replica's prepared SSD branches and kept
    draft rows (specdec.drafter.speculate)."""

    runtime: Engine[Any]
    branches: BranchStore
    session_id: str
    prefix: Prefix
    new_tokens: Sequence[int]
    k: int
    params: SamplingParams
    controls: Controls | None = None
    fork_from: str = ""
    tree_nodes: int = 0
    tree_width: int = 1
    tree_depth: int = 0

    def job(self) -> Generator[ModelRequest, torch.Tensor, DraftResult]:
        return propose(self)


def propose(call: DraftCall) -> Generator[ModelRequest, torch.Tensor, DraftResult]:
    """Draft the call's k tokens (see DraftCall): a job for the model thread
    (`Engine.run`).

    If Speculate prepared a draft for exactly this sequence it is returned without a
    forward and the cache stays at the prefix. Otherwise the cache ends holding
    prefix + new_tokens + d_1..d_{k-1}: d_k is only fed if it is accepted, in the next
    request's new tokens (or by the Speculate that follows, which then reuses the logits
    kept here instead of feeding d_1..d_{k-1} again). A tree's nodes leave the cache as it
    is; a prepared draft stays a chain.
    """
    runtime, branches, session_id, prefix = (
        call.runtime,
        call.branches,
        call.session_id,
        call.prefix,
    )
    new_tokens, k, params, controls = call.new_tokens, call.k, call.params, call.controls
    tree_nodes, tree_width = call.tree_nodes, call.tree_width
    with runtime.guarded(session_id):
        started = time.perf_counter()
        branches.pop_rows(session_id)
        session = runtime.ready_store.acquire(
            session_id,
            prefix.length,
            prefix.hash,
            len(new_tokens) + k - 1,
            fork_from=call.fork_from,
        )
        hit = take_prepared(branches, session_id, session, new_tokens, k, params, controls)
        if hit is not None:
            tokens, probs = hit
            return DraftResult(tokens, probs, len(session.tokens), _ms(started), prepared=True)
        last = (yield from runtime.forward_steps(session, new_tokens, keep=1))[-1:]  # [1, vocab]
        position = prefix.length + len(new_tokens)  # index of d_1 in the sequence
        counts = None
        if controls is not None:  # the sequence's statistics, then each drawn token's
            counts = TokenCounts(controls, session.tokens, [()], last.shape[-1], last.device)
        sampler = sampler_for(params, runtime, counts)
        drawn: list[torch.Tensor] = []  # [1] each: the draft, on the device
        proposals: list[torch.Tensor] = []  # [1, vocab] each, under sampling
        rows: list[torch.Tensor] = []  # [1, vocab] logits each token was drawn from
        for i in range(k):
            rows.append(last)
            token, proposal = sampler.draw(last, [position + i])
            drawn.append(token)
            if proposal is not None:
                proposals.append(proposal)
            if i < k - 1:  # the device token is the next input: no copy to the host
                last = (yield from runtime.forward_steps(session, token))[-1:]
        tokens_d = torch.cat(drawn)
        payload = sampler.payload(proposals)
        top = tree_tops(rows, proposals, tokens_d, tree_width) if tree_nodes > 0 else ()
        host = to_host(tokens_d, *payload, *top)  # the Draft's one copy
        tokens = host[0].tolist()
        runtime.ready_store.fill(session, tokens[: k - 1])  # the device tokens it fed
        encoded = encoded_rows(host[1 : 1 + len(payload)]) if proposals else []
        branches.put_rows(session_id, DraftRows.after(session, position, rows))
        if not top:
            return DraftResult(tokens, encoded, len(session.tokens), _ms(started))
        top_host = [t.tolist() for t in host[len(host) - 3 :]]
        tokens, parents, encoded = yield from grow_tree(
            call, session, position, tokens, top_host, encoded, bool(proposals)
        )
        return DraftResult(tokens, encoded, len(session.tokens), _ms(started), parents=parents)


def grow_tree(
    call: DraftCall,
    session: CachedSession,
    position: int,
    chain: list[int],
    top: Sequence[list[Any]],
    encoded: list[EncodedProbs],
    sampled: bool,
    feeds: Sequence[torch.Tensor] = (),
) -> Generator[ModelRequest, torch.Tensor, tuple[list[int], list[int], list[EncodedProbs]]]:
    """The call's tree grown from its drawn chain (d_1 at `position`): the leaves `plan`
    picks from `top` (`tree_tops`, on the host), the best continued by tree_depth tokens
    drawn as branch rows (`continue_leaves`). (tokens, parents, encoded distributions);
    parents [] when no leaf is kept. feeds: a head's, the feature each chain position
    is fed with [1, width] (a continued leaf at that position is fed it too)."""
    runtime = call.runtime
    cfg = runtime.config
    assert isinstance(cfg, DrafterConfig)  # the drafter's runtime has its config
    budget = branch_budget(  # continued leaves are branch rows: SSD's KV bound holds
        cfg.ssd_max_branch_tokens, len(session.tokens), call.tree_depth
    )
    conf, values, indices = top
    leaves, parents, continued = plan(
        chain, conf, indices, values, call.tree_nodes, call.tree_width, call.tree_depth, budget
    )
    tokens = [*chain, *leaves]
    encoded = [*encoded, *(one_hot_encoded(t) for t in leaves)] if sampled else encoded
    if continued:
        keys = [(parents[node] + 1, tokens[node]) for node in continued]
        more, more_parents, more_probs = yield from continue_leaves(
            sampler_for(call.params, runtime, salt=TREE_SALT),
            session,
            position,
            keys,
            continued,
            len(tokens),
            call.tree_depth,
            torch.cat([feeds[a] for a, _ in keys]) if feeds else None,
        )
        tokens += more
        parents += more_parents
        encoded += more_probs
    return tokens, parents, encoded


def tree_tops(
    rows: list[torch.Tensor],
    proposals: list[torch.Tensor],
    drawn: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, ...]:
    """What `plan` reads of a chain's draft, on the device: each drawn token's probability
    [k], and each row's `width` likeliest tokens' probabilities and ids [k, width] (rows:
    the [1, vocab] logits each token was drawn from; proposals: the distributions it was
    drawn from, under sampling). () for a chain (width 1)."""
    if width <= 1:
        return ()
    dist = torch.cat(proposals) if proposals else torch.softmax(torch.cat(rows).float(), -1)
    best = torch.topk(dist, min(width, dist.shape[-1]), dim=-1)
    return dist.gather(1, drawn[:, None])[:, 0], best.values, best.indices


def continue_leaves(
    sampler: Sampler,
    session: CachedSession,
    position: int,
    keys: Sequence[tuple[int, int]],
    nodes: Sequence[int],
    first: int,
    depth: int,
    inputs: torch.Tensor | None = None,
) -> Generator[ModelRequest, torch.Tensor, tuple[list[int], list[int], list[EncodedProbs]]]:
    """`depth` tokens drawn after each leaf: (their tokens, parents, distributions), node
    numbers from `first` on, leaf by leaf. keys[j] = (i, x): leaf nodes[j] is token x in
    place of draft token i (0-based), so its row sees the session's first position + i
    slots (the sequence and d_1..d_i), then its own tokens; depth forwards over all rows
    (SSD's `draft_branches`; inputs: a head's, each leaf's input feature [rows, width])."""
    branches = yield from draft_branches(session, position, keys, depth, sampler, inputs)
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[EncodedProbs] = []
    for leaf, branch in zip(nodes, branches, strict=True):
        for step, token in enumerate(branch.tokens):
            parents.append(leaf if step == 0 else first + len(tokens) - 1)
            tokens.append(token)
        probs += branch.probs
    return tokens, parents, probs


def plan(
    tokens: Sequence[int],
    confidence: Sequence[float],
    alternatives: Sequence[Sequence[int]],
    probs: Sequence[Sequence[float]],
    nodes: int,
    width: int,
    depth: int = 0,
    max_rows: int = 1 << 30,
) -> tuple[list[int], list[int], list[int]]:
    """A draft's tree: (the leaves to add, the parents of the draft and the leaves, the
    leaves to continue by `depth` tokens, as node numbers, best first). tokens [k]: the
    draft; confidence [k]: each draft token's probability under the drafter;
    alternatives / probs [k][w]: each row's top tokens and their probabilities. Each
    leaf is an alternative a to draft token i (a != tokens[i], at most width - 1 per i),
    scored by its path probability confidence[0] ... confidence[i-1] probs[i][a]. Of the
    `nodes` budget, each continued leaf costs 1 + depth: the best nodes // (1 + depth)
    leaves (none when depth is 0; at most max_rows, the branch rows' memory bound) are
    continued and what is left buys terminal leaves,
    the next best; only leaves with a positive score, numbered after the draft by
    position then rank, each the child of draft token i - 1 (-1: of the context).
    ([], [], []) when none is kept."""
    candidates: list[tuple[float, int, int]] = []  # (score, position, token)
    reach = 1.0
    for i, token in enumerate(tokens):
        taken = 0
        for alt, p in zip(alternatives[i], probs[i], strict=True):
            if taken >= width - 1:
                break
            if alt == token:
                continue
            taken += 1
            if reach * p > 0:
                candidates.append((reach * p, i, alt))
        reach *= confidence[i]
    rows = max(0, nodes) // (1 + depth) if depth > 0 else 0
    ranked = sorted(candidates, key=lambda c: -c[0])
    rows = min(rows, len(ranked), max_rows)
    kept = ranked[: rows + max(0, nodes) - rows * (1 + depth)]
    if not kept:
        return [], [], []
    order = {(i, alt): n for n, (_, i, alt) in enumerate(candidates)}
    kept.sort(key=lambda c: order[(c[1], c[2])])
    node = {(i, alt): len(tokens) + n for n, (_, i, alt) in enumerate(kept)}
    parents = [i - 1 for i in range(len(tokens))] + [i - 1 for _, i, _ in kept]
    continued = [node[(i, alt)] for _, i, alt in ranked[:rows]]
    return [alt for _, _, alt in kept], parents, continued


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1e3
