"""Speculative speculative decoding on the drafter (DESIGN §4; Kumar, Dao, May, Saguaro).

While the verifier checks a round's draft d_1..d_k after the sequence x (length L), the
drafter prepares next-round drafts for the likeliest verification outcomes (a, t): a draft
tokens accepted, then token t (the recovered token when a < k, the bonus token when a = k).

Which outcomes. Each draft token d_i is accepted with probability c_i, and outcome a has
probability c_1..c_a (1 - c_{a+1}) for a < k and c_1..c_k for a = k. Two outcome models
(`--ssd-outcomes`):

- `confidence` (the default): c_i is the drafter's own probability of d_i (its ranking
  distribution at that position, clamped to ALPHA_RANGE). The draft need not be the
  drafter's: under hybrid the gateway sends a lookup draft, or the drafter's draft
  followed by a lookup's extension, and the drafter scores every position of it.
  Where the drafter doubts a lookup token the branches go to its rejection; where it
  agrees they go further. On the input-grounded prompts with hybrid drafts, k = 2, this
  made 94 SSD hits in 130 rounds against 60 under `geometric` (2026-11-26, Intel Xeon).
- `geometric`: an i.i.d. rate alpha (the request's running acceptance rate, else the
  replica's `--ssd-acceptance-prior`) for every position, as in the paper: the fan-out
  falls geometrically with a.

The next token is guessed from the drafter's own distributions: for a < k the target
rejected d_{a+1}, so the candidates are the drafter's likeliest tokens at that position
other than d_{a+1} (renormalised); for a = k, the likeliest tokens after d_k. A branch
(a, t) scores P(a) q(t | a); the `fan_out` best are drafted, at most `max_per_outcome`
per a.

How they are drafted. One forward feeds the request's new tokens (which end with the
draft) into the session's cache, which then holds x + d_1..d_k and gives the drafter's
distribution at every draft position. After a Draft on this replica the cache already
holds x + d_1..d_{k-1}, and the Draft kept the logits it drew d_1..d_k from (`DraftRows`):
the gateway then names that longer prefix and sends d_k alone, and only d_k is fed (the
distributions of the earlier positions are the Draft's). Without those rows (the Draft
was answered from a branch, or they were dropped) the cache is rolled back to x and the
draft fed again from the session's own tokens: slower, the same result. Every branch
(a, t) shares x + d_1..d_a: it is one row of a batch over the session's cache (a
`BranchGroup`), the slots of d_{a+1}..d_k are masked out of that row's attention, and t is
fed at its true position L + a. Each of the branch_k steps is then one forward
over all branches (a `BranchStep`). A group keeps only its rows' own new keys/values
between steps (fan_out x branch_k slots); the session's own cache only gained the draft.

Batching across sessions (specdec.replica.batching): `speculate` is a model-thread job; its
first forward (feeding the draft) and each of its branch steps are requests the scheduler
batches with other sessions' forwards, so the branch steps of several sessions (and their
Draft steps) run as one padded forward.

The prepared branches (tokens and, under sampling, the distributions they were drawn from)
stay on the replica in a BranchStore, for the MAX_PREPARED_SESSIONS most recent sessions
(they serve one round; under sampling a branch holds k dense distributions). A Draft for
exactly x + d_1..d_a + t takes its branch without a forward; any other Draft discards them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from specdec.common.controls import Controls
from specdec.common.prefix import prefix_hash
from specdec.drafter.config import CONFIDENCE, GEOMETRIC, OUTCOME_MODELS
from specdec.drafter.sampler import Sampler, sampler_for
from specdec.replica.batching import BranchGroup, BranchStep, ForwardRequest, ModelRequest
from specdec.replica.engine import CachedSession, Engine, Prefix
from specdec.replica.features import FeatureSink
from specdec.replica.host import to_host
from specdec.replica.processors import TokenCounts, verify_logits
from specdec.replica.sampling import EncodedProbs, SamplingParams, encoded_rows, warp

V = TypeVar("V")

MAX_PREPARED_SESSIONS = 32
# Outcome probabilities are ranked with acceptance probabilities clamped away from 0 and
# 1, so that every accept length keeps some weight.
ALPHA_RANGE = (0.05, 0.95)


@dataclass
class Branch:
    accepted: int  # a: draft tokens accepted in the outcome
    next_token: int  # t: the recovered (a < k) or bonus (a = k) token
    tokens: list[int]  # the prepared next-round draft
    probs: list[EncodedProbs]  # what each was sampled from; empty under greedy


@dataclass
class Prepared:
    """Branches prepared for the draft that follows the first base_length tokens."""

    base_length: int
    base_hash: int
    draft: list[int]
    params: SamplingParams
    branches: dict[tuple[int, int], Branch]
    controls: Controls | None = None


@dataclass
class DraftRows:
    """The logits a Draft drew its tokens from, kept for the Speculate that follows it.

    rows[i] is the drafter's distribution of the token at position start + i (after the
    first start + i tokens), i = 0..k-1; the Draft left the session's cache at `length`
    tokens (start + k - 1) whose prefix hash is `hash`.
    """

    start: int
    length: int
    hash: int
    rows: torch.Tensor  # [k, vocab] fp32 logits
    # A head drafter's (specdec.drafter.head): the feature each of positions start..start +
    # k - 1 was (or, the last, would be) fed with [k, width]. None for a model.
    feeds: torch.Tensor | None = None

    @classmethod
    def after(
        cls,
        session: CachedSession,
        start: int,
        rows: list[torch.Tensor],
        feeds: list[torch.Tensor] | None = None,
    ) -> DraftRows:
        """A Draft's rows ([1, vocab] each, d_1 at `start`), kept at the session's cache."""
        n = len(session.tokens)
        kept = torch.cat(feeds) if feeds is not None else None
        return cls(start, n, session.chain.hash(session.tokens, n), torch.cat(rows), kept)

    def covers(self, cached: int, prefix_hash: int, base: int) -> bool:
        """Whether these rows hold for a sequence whose cache is `cached` tokens of hash
        `prefix_hash` and whose draft begins at `base`: the Draft left the cache exactly
        there and began no later."""
        return (self.length, self.hash) == (cached, prefix_hash) and self.start <= base


class BranchStore:
    """Prepared branches by session, newest last, bounded to MAX_PREPARED_SESSIONS; and
    the logits of each session's last Draft (`DraftRows`), bounded the same way.

    Drafter state only; like the KV caches, used from the model thread only.
    """

    def __init__(self, max_sessions: int = MAX_PREPARED_SESSIONS):
        self.max_sessions = max_sessions
        self._by_session: OrderedDict[str, Prepared] = OrderedDict()
        self._rows: OrderedDict[str, DraftRows] = OrderedDict()
        self.refed_tokens = 0  # cached draft tokens fed again for want of DraftRows

    @staticmethod
    def _put(store: OrderedDict[str, V], session_id: str, value: V, bound: int) -> None:
        store[session_id] = value
        store.move_to_end(session_id)
        while len(store) > bound:
            store.popitem(last=False)

    def put(self, session_id: str, prepared: Prepared) -> None:
        self._put(self._by_session, session_id, prepared, self.max_sessions)

    def pop(self, session_id: str) -> Prepared | None:
        return self._by_session.pop(session_id, None)

    def put_rows(self, session_id: str, rows: DraftRows) -> None:
        self._put(self._rows, session_id, rows, self.max_sessions)

    def pop_rows(self, session_id: str) -> DraftRows | None:
        return self._rows.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        self._by_session.pop(session_id, None)
        self._rows.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._by_session)


@dataclass
class SpeculateResult:
    branches: list[Branch]
    cached_length: int
    forward_ms: float


@dataclass(frozen=True)
class SpeculateCall:
    """A validated Speculate, what `speculate` prepares: branches of branch_k tokens for
    the k-token draft that ends prefix + new_tokens (which holds at least k + 1 tokens);
    new_tokens may start inside the draft when the session's last Draft cached its
    beginning (see the module docstring). fan_out, alpha, max_per_outcome, outcomes: which
    outcomes get a branch (`rank_outcomes`).

    max_branch_tokens (0: unbounded) bounds the branch rows' KV, one copy of the session's
    KV per branch in each of their forwards: fan_out shrinks to what fits, down to no
    branch. controls: the request's logits processors, applied to the ranking rows (with
    the draft up to each) and to every branch step (with the branch's own tokens). store:
    where the prepared branches stay (and the last Draft's rows are taken from)."""

    runtime: Engine[Any]
    store: BranchStore
    session_id: str
    prefix: Prefix
    new_tokens: Sequence[int]
    k: int
    branch_k: int
    params: SamplingParams
    fan_out: int
    alpha: float
    max_per_outcome: int
    max_branch_tokens: int = 0
    controls: Controls | None = None
    outcomes: str = CONFIDENCE

    def job(self) -> Generator[ModelRequest, torch.Tensor, SpeculateResult]:
        return speculate(self)

    def rows(
        self, session: CachedSession, memo: DraftRows | None
    ) -> Generator[ForwardRequest, torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]:
        """The draft fed (`draft_rows`): the drafter's logits at every draft position and
        after it [k+1, vocab], and what outcome a's next token is fed with [k+1, width] (a
        head drafter's, specdec.drafter.head; None for a model)."""
        rows = yield from draft_rows(
            self.runtime, self.store, session, memo, self.prefix, self.new_tokens, self.k
        )
        return rows, None


def speculate(call: SpeculateCall) -> Generator[ModelRequest, torch.Tensor, SpeculateResult]:
    """Prepare next-round drafts for the draft at the end of prefix + new_tokens (see
    SpeculateCall): a job for the model thread (`Engine.run`)."""
    runtime, store, session_id, prefix = call.runtime, call.store, call.session_id, call.prefix
    new_tokens, k, branch_k, params = call.new_tokens, call.k, call.branch_k, call.params
    controls = call.controls
    with runtime.guarded(session_id):
        started = time.perf_counter()
        store.pop(session_id)
        memo = store.pop_rows(session_id)
        session = runtime.ready_store.acquire(
            session_id, prefix.length, prefix.hash, len(new_tokens)
        )
        rows, feeds = yield from call.rows(session, memo)  # [k+1, vocab], [k+1, width]
        base = len(session.tokens) - k
        draft = session.tokens[base:]
        rows = verify_logits(controls, session.tokens[:base], draft, rows)
        ranking = rows.softmax(-1) if params.greedy else warp(rows, params)
        budget = branch_budget(call.max_branch_tokens, len(session.tokens), branch_k)
        fan_out = min(call.fan_out, budget)
        keys = (
            rank_outcomes(ranking, draft, call.alpha, fan_out, call.max_per_outcome, call.outcomes)
            if fan_out
            else []
        )
        counts = None
        if controls is not None:  # branch (a, t) continues x + d_1..d_a + t
            tails = [[*draft[:a], t] for a, t in keys]
            counts = TokenCounts(
                controls, session.tokens[:base], tails, rows.shape[-1], rows.device
            )
        inputs = feeds[[a for a, _ in keys]] if feeds is not None and keys else None
        branches = yield from draft_branches(
            session, base, keys, branch_k, sampler_for(params, runtime, counts), inputs
        )
        store.put(
            session_id,
            Prepared(
                base_length=base,
                base_hash=session.chain.hash(session.tokens, base),
                draft=draft,
                params=params,
                branches={(b.accepted, b.next_token): b for b in branches},
                controls=controls,
            ),
        )
        return SpeculateResult(branches, len(session.tokens), (time.perf_counter() - started) * 1e3)


def draft_rows(
    runtime: Engine[Any],
    store: BranchStore,
    session: CachedSession,
    memo: DraftRows | None,
    prefix: Prefix,
    new_tokens: Sequence[int],
    k: int,
) -> Generator[ForwardRequest, torch.Tensor, torch.Tensor]:
    """Feed new_tokens (the job's forwards); the drafter's logits at every draft position
    and after the draft [k+1, vocab]: row a is the distribution of the token after d_1..d_a.

    The session holds the prefix. Rows for positions the prefix already covers come from
    the Draft that cached them (memo); without it the cache rolls back to the token before
    the draft and those tokens are fed again.
    """
    cached = len(session.tokens)
    base = cached + len(new_tokens) - k  # the position of d_1
    if cached < base:  # the prefix ends before the draft: feed it all (the usual path)
        return (yield from runtime.forward_steps(session, new_tokens, keep=k + 1))
    if memo is not None and memo.covers(cached, prefix.hash, base):
        fresh = yield from runtime.forward_steps(
            session, new_tokens, keep=len(new_tokens)
        )  # [new, vocab]
        return torch.cat([memo.rows[base - memo.start :], fresh])
    tokens = [*session.tokens[base - 1 :], *new_tokens]
    store.refed_tokens += cached - (base - 1)
    runtime.ready_store.truncate(session, base - 1)
    return (yield from runtime.forward_steps(session, tokens, keep=k + 1))


def branch_budget(max_branch_tokens: int, length: int, branch_k: int) -> int:
    """Branches whose rows (a copy of `length` + `branch_k` tokens of KV each, in a forward)
    fit max_branch_tokens; unbounded (a large number) when it is 0."""
    if not max_branch_tokens:
        return 1 << 30
    return max_branch_tokens // (length + branch_k)


def rank_outcomes(
    probs: torch.Tensor,
    draft: Sequence[int],
    alpha: float,
    fan_out: int,
    max_per_outcome: int,
    outcomes: str = CONFIDENCE,
) -> list[tuple[int, int]]:
    """The fan_out likeliest outcomes (a, t), likeliest first.

    probs: [k+1, vocab] on the device, row a the drafter's distribution of the token after
    d_1..d_a. Scored there; one copy to the host of each accept length's best candidates.
    outcomes: CONFIDENCE (d_i accepted with the drafter's probability of it) or GEOMETRIC
    (with alpha), see the module docstring.
    """
    k = len(draft)
    positions = torch.arange(k, device=probs.device)
    drafted = torch.tensor(list(draft), dtype=torch.long, device=probs.device)
    if outcomes == CONFIDENCE:
        accept = probs[positions, drafted].float()  # [k]
    elif outcomes == GEOMETRIC:
        accept = torch.full((k,), float(alpha), device=probs.device)
    else:
        raise ValueError(f"unknown outcome model {outcomes!r}; known: {OUTCOME_MODELS}")
    accept = accept.clamp(*ALPHA_RANGE)
    # P(a): a accepted (the product of the first a), then a rejection (or all k accepted)
    reach = torch.cat([accept.new_ones(1), torch.cumprod(accept, 0)])  # [k+1]
    outcome = (reach * torch.cat([1 - accept, accept.new_ones(1)]))[:, None]  # [k+1, 1]
    q = probs.clone()
    q[positions, drafted] = 0.0
    total = q.sum(-1, keepdim=True)  # [k+1, 1]: the mass left at each accept length
    top = torch.topk(q, min(max_per_outcome, q.shape[-1]), dim=-1)  # [k+1, m]
    score = torch.where(total > 0, outcome * top.values / total.clamp_min(1e-30), 0.0)
    score, ids = to_host(score, top.indices)  # the ranking's one copy
    scored = [
        (p, a, t)
        for a, (row, row_ids) in enumerate(zip(score.tolist(), ids.tolist(), strict=True))
        for p, t in zip(row, row_ids, strict=True)
        if p > 0.0
    ]
    scored.sort(key=lambda x: (-x[0], x[1], x[2]))
    return [(a, t) for _, a, t in scored[:fan_out]]


def draft_branches(
    session: CachedSession,
    base: int,
    keys: Sequence[tuple[int, int]],
    branch_k: int,
    sampler: Sampler,
    inputs: torch.Tensor | None = None,
) -> Generator[BranchStep, torch.Tensor, list[Branch]]:
    """Draft `branch_k` tokens after base + d_1..d_a + t for every key (a, t): a job's
    forwards, one BranchStep of every branch per step, batched with other jobs' forwards
    (other sessions' branch steps, Draft steps, ...) by the model thread's scheduler. The
    tokens stay on the device between steps; one copy to the host at the end.

    Row (a, t) sees the session's first base + a cached tokens (d_{a+1}..d_k are hidden
    from it), then its own tokens; t sits at its true position base + a.

    inputs: a head drafter's rows (specdec.drafter.head): the feature each row's t is fed
    with [rows, width]; every later token is fed the head's own output at the token
    before it (its one decoder layer's), as a head's chain is."""
    if not keys:
        return []
    group = BranchGroup(session, [base + a for a, _ in keys])
    tokens: list[int] | torch.Tensor = [t for _, t in keys]
    drawn: list[torch.Tensor] = []  # [rows] per step
    proposals: list[torch.Tensor] = []  # [rows, vocab] per step, under sampling
    for step in range(branch_k):
        sink = FeatureSink((0,)) if inputs is not None else None
        logits = yield BranchStep(group, tokens, features=sink, inputs=inputs)  # [rows, vocab]
        if sink is not None:
            inputs = sink.tensor()  # [rows, width]: what each row's next token is fed
        # each row's next token, at position base + a + step + 1
        tokens, proposal = sampler.draw(logits, [v + step + 1 for v in group.visible])
        drawn.append(tokens)
        if proposal is not None:
            proposals.append(proposal)
    rows = len(keys)
    by_step = sampler.payload(proposals)  # [branch_k * rows, ...], step-major
    host = to_host(torch.stack(drawn, dim=1), *by_step)  # the branches' one copy
    tokens_by_row = host[0].tolist()  # [rows][branch_k]
    encoded = encoded_rows(host[1:]) if proposals else []
    return [
        Branch(a, t, tokens_by_row[row], encoded[row::rows] if encoded else [])
        for row, (a, t) in enumerate(keys)
    ]


def take_prepared(
    store: BranchStore,
    session_id: str,
    session: CachedSession,
    new_tokens: Sequence[int],
    k: int,
    params: SamplingParams,
    controls: Controls | None = None,
) -> tuple[list[int], list[EncodedProbs]] | None:
    """The prepared draft for session.tokens + new_tokens, if Speculate made one; the
    session's branches are discarded either way (they only serve the next round)."""
    prepared = store.pop(session_id)
    if prepared is None or prepared.params != params or prepared.controls != controls:
        return None
    cached = session.tokens
    base = prepared.base_length
    a = len(cached) + len(new_tokens) - 1 - base
    if not 0 <= a <= len(prepared.draft):
        return None

    def at(i: int) -> int:  # token i of cached + new_tokens, without copying the context
        return cached[i] if i < len(cached) else new_tokens[i - len(cached)]

    if [at(i) for i in range(base, base + a)] != prepared.draft[:a]:
        return None
    branch = prepared.branches.get((a, new_tokens[-1]))
    if branch is None or len(branch.tokens) < k:
        return None
    if base <= len(cached):
        base_hash = session.chain.hash(cached, base)
    else:  # rare: the caller named a shorter prefix than the prepared base
        base_hash = prefix_hash([*cached, *new_tokens][:base])
    if base_hash != prepared.base_hash:
        return None
    return branch.tokens[:k], branch.probs[:k]
