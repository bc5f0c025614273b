"""The speculation loop of DESIGN §2 as the gateway runs it, one request at a time.

A round: the draft (a `Draft` on a drafter, a draft SSD prepared, or none), SSD's
`Speculate` beside the `Verify` when SSD is on, the verdict. It returns one frozen
`Outcome` (specdec.gateway.outcome) and keeps no books: the request's statistics, the k
policy and the round's span observe the outcome. The calls go through the request's
`ReplicaCaller` (specdec.gateway.fleet.caller), which names the cached prefix of each call and
absorbs cache misses, busy replicas and failover; misses and failover cost time, never
tokens.

With SSD (DESIGN §4) Speculate(t) leaves with Verify(t): the drafter prepares next-round
drafts for the likeliest outcomes while the verifier works. If the verified outcome
(accepted count, next token) is one of them, that is a hit: under greedy decoding the
gateway already holds the next draft and Verify(t+1) leaves at once; under sampling the
Draft(t+1) call is answered from the prepared branch with its distributions, without a
forward. A miss is a normal Draft. A Speculate still running at the verdict is late: it
is cancelled, not awaited; if the drafter had started it, it still stores its branches
and the next Draft (queued behind it on the drafter) is answered from them when its
outcome was prepared, which that round's outcome reports. The verifier applies the same
rule to whatever draft it gets, so SSD changes speed only, never tokens. Losing every
drafter degrades a round to k = 0 (the same output, slower); it never fails a request.

A round's draft may also come from the request's lookup proposer
(specdec.gateway.round.lookup: prompt lookup, suffix decoding, a prediction), built here from
the token ids the gateway holds, without a drafter call; under hybrid, prompt lookup also
extends the drafter's draft in the same round (`_extend`). Its distribution is one-hot, so
under sampling it travels as SparseProbs(token_ids=[d], probs=[1.0]) and the verifier's
rule accepts d with probability p(d) and recovers from p without d. The next round's
lookup draft is computed when the verdict arrives, in microseconds, so there is nothing to
prepare for it; but under hybrid the next round may fall back to the draft model, so with
SSD every hybrid round's Speculate covers the whole draft under verification (a lookup
draft, or the model's draft and its extension) and prepares the model's next draft for
its likeliest outcomes, on the drafter's otherwise idle core. A lookup method (ngram,
suffix) never asks the drafter: its rounds send no Speculate, and the drafter's cache
stays behind; a later Draft names the prefix it still holds and sends what follows
(`new_tokens`), as after any other gap.

With a tree width above 1 (SpeculationParams.tree_width) a lookup round verifies its
source's other candidate continuations beside its draft, as one token tree
(specdec.gateway.round.lookup.tree, VerifyRequest.draft_parents): the draft is the first
branch, cut to the length the policy chose; each other branch starts with another token
and gets an equal share of what the policy sizes for them (`Policy.tree_sizes`).
The draft model's rounds grow a dynamic tree on the drafter (DraftRequest.tree_nodes:
its top alternatives to the draft's tokens as leaves, the best continued by more drafter
forwards (tree_depth), sized by `Policy.model_tree`).
The verdict's accepted path is the round's accepted tokens. With SSD a tree round's
Speculate prepares for the outcomes of its first branch (the draft a chain would be): a
path that leaves it is a miss, but for a greedy path through one drafter leaf (and its
continuation) whose prepared "recovered" branch drafted the rest (`_through_leaf`). A request with logits processors that read the sequence,
a grammar or logprobs verifies chains only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from specdec.common.controls import processes_logits
from specdec.common.params import SamplingParams
from specdec.gateway.fleet.caller import Placement, ReplicaCaller, UpstreamError
from specdec.gateway.fleet.replicas import Replica
from specdec.gateway.fleet.transport import Method
from specdec.gateway.job import NO_SCORING, Speculation
from specdec.gateway.names import LOOKUP_SOURCES, KPolicy, Role, Source, Ssd
from specdec.gateway.observe import metrics, tracing
from specdec.gateway.outcome import Outcome, RequestStats
from specdec.gateway.round.features import FeatureRelay
from specdec.gateway.round.grammar import Constraint
from specdec.gateway.round.lookup import HYBRID, MODEL, PREDICTION
from specdec.gateway.round.lookup.hybrid import RequestLookup
from specdec.gateway.round.lookup.tree import graft, is_chain, merge
from specdec.gateway.round.policy import Policy
from specdec.sdk.errors import Unavailable
from specdec.sdk.request import Scoring
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Draft:
    """A round's draft and where it came from."""

    tokens: Sequence[int]  # [k]
    probs: Sequence[common_pb2.DraftDistribution]  # [k] under sampling, else empty
    source: Source
    seconds: float = 0.0  # the gateway's wait for its Draft call
    resends: int = 0
    late_outcome: Ssd | None = None  # the previous round's late Speculate, decided now
    extended: int = 0  # lookup tokens appended to the draft model's draft (hybrid)
    forward_ms: float = 0.0  # the Draft's forwards, as the drafter reported them
    fed: int = 0  # tokens the Draft call fed (its new tokens: a prefill or resend is long)
    parents: Sequence[int] = ()  # a token tree's (VerifyRequest.draft_parents); (): a chain
    chain: int = 0  # a tree's first branch: its tokens (the first nodes)
    leaves: int = 0  # the drafter's tree: its alternatives to the draft's tokens
    depth: int = 0  # the drafter's tree: the forwards that continued its leaves


@dataclass(slots=True)
class SpeculateCall:
    """The Speculate sent beside a round's Verify (task None: SSD off or paused)."""

    state: Ssd  # OFF, PAUSED or SENT
    task: asyncio.Task[tuple[drafter_pb2.SpeculateResponse, Replica, float]] | None = None
    fan_out: int | None = None
    branch_k: int = 0
    sent: float = 0.0
    request_bytes: int = 0


@dataclass(frozen=True, slots=True)
class SsdVerdict:
    """What a round's Speculate gave once its Verify answered."""

    state: Ssd  # OFF, PAUSED, HIT, MISS or LATE
    branches: int = 0
    seconds: float | None = None  # its round trip, when it answered in time
    bytes: int = 0
    hidden: float = 0.0  # seconds of it that overlapped the Verify


def one_hot(token: int) -> common_pb2.DraftDistribution:
    """The proposal distribution of a deterministic (lookup) draft token."""
    return common_pb2.DraftDistribution(
        sparse=common_pb2.SparseProbs(token_ids=[token], probs=[1.0])
    )


class Speculator:
    """Runs the rounds of one request."""

    def __init__(
        self,
        caller: ReplicaCaller,
        replica_session: str,
        sampling: SamplingParams,
        drafter: Placement,
        verifier: Placement,
        policy: Policy,
        *,
        speculation: Speculation,
        scoring: Scoring = NO_SCORING,
        max_context: int,
        lookup_max_k: int = 0,
        output: common_pb2.OutputControls | None = None,
        constraint: Constraint | None = None,
        lookup: RequestLookup | None = None,
    ):
        """One request's rounds: `speculation` (its SSD and tree width; the k of each round
        is the turn's, `round`'s max_k), `scoring` (what each Verify scores: the prompt
        with the first round's), the context bound and the largest lookup draft (the
        replicas' largest k), the output controls every call carries with the sampling,
        the grammar state and the lookup proposer."""
        self.caller = caller
        self.session = replica_session
        self.sampling = sampling.to_proto()  # the wire form every replica call carries
        self.drafter = drafter
        self.verifier = verifier
        self.policy = policy
        policy.bind(drafter, verifier, caller.fleet)  # it prices drafts with their cost curves
        self.ssd = speculation.ssd
        self.max_context = max_context
        # Where the request's output starts and its min_tokens mask: every replica call
        # carries it with the sampling (the logits processors need both).
        self.output = output
        # Structured output: the request's grammar state, advanced by its turn
        # (specdec.gateway.round.grammar); it cuts each draft and masks each verified position.
        self.constraint = constraint
        self.lookup = lookup  # the request's lookup proposer (None: the draft model alone)
        self.lookup_max_k = lookup_max_k  # bound of a lookup draft (the replicas' largest k)
        self.greedy = sampling.greedy
        # Candidate continuations a lookup round verifies as a tree (1: a chain); what the
        # verifier cannot score on a tree yet keeps chains.
        tree_ok = not (
            constraint is not None
            or scoring.logprobs
            or scoring.prompt_logprobs
            or processes_logits(self.sampling, output)
        )
        self.tree_width = speculation.tree_width if tree_ok else 1
        self.stats = RequestStats(adaptive=policy.kind == KPolicy.ADAPTIVE)
        self._ready: tuple[int, list[int]] | None = None  # greedy SSD hit: (ctx length, draft)
        self._prediction: list[int] | None = None  # to graft onto this round's model draft
        self._late = False  # the last Speculate was still running at its verdict
        self._without_drafter = False  # the last Draft found no drafter
        self._index = 0
        # Scores asked of each Verify (with top_logprobs alternatives per token); the
        # prompt's with the first round's.
        self.scoring = scoring
        # n > 1 (specdec.gateway.front.choices): per role, the replica session whose cache the
        # next call that names a prefix starts from (VerifyRequest.fork_from).
        self.fork_from: dict[Role, str] = {}
        self.features = FeatureRelay(caller.fleet)  # a head drafter's, verifier to drafter

    async def round(self, ctx: Sequence[int], max_k: int, remaining: int) -> Outcome:
        """One round after ctx, drafting at most max_k tokens (the policy picks k); with SSD
        a Speculate only when some outcome leaves room (`remaining` tokens may still be
        generated, >= max_k + 1) for another round with a draft."""
        started = time.perf_counter()
        self.policy.estimate = None  # what this round's decisions price (Outcome.gain)
        with tracing.round_span(self._index) as span:
            draft = self._lookup(ctx, max_k, remaining)
            if draft is None:
                # A head drafter's first draft waits for the prompt's features.
                k = 0 if self.features.awaits_prompt(self.drafter) else self.policy.choose_k(max_k)
                draft = self._extend(ctx, await self._draft(ctx, k), remaining)
                draft = self._graft_prediction(ctx, draft, remaining)
            draft, masks = self._constrain(draft)
            speculation = self._speculate(
                ctx, _first_branch(draft), remaining, self._branch_k(draft, max_k)
            )
            verify_sent = time.perf_counter()
            verdict, resends, fed = await self._verify(ctx, draft, speculation, masks)
            path = list(verdict.accepted_path)
            verified = time.perf_counter()
            ssd = self._settle(speculation, verdict, ctx, verify_sent, verified, draft)
            if ssd.state == Ssd.LATE:
                await asyncio.sleep(0)  # the cancel leaves before the next drafter call
            estimate = self.policy.estimate
            outcome = Outcome(
                index=self._index,
                max_k=max_k,
                k=len(draft.tokens),
                # a tree's accepted path first, then its other nodes
                draft=_path_first(draft.tokens, path),
                width=_width(draft.parents),
                branch=_branch(draft.parents, path, draft.chain),
                chain=draft.chain,
                on_chain=_on_chain(path, draft.chain) if draft.parents else 0,
                tree_leaves=draft.leaves,
                tree_depth=draft.depth,
                extended=draft.extended,
                accepted=verdict.accepted_count,
                next_token=verdict.next_token,
                source=draft.source,
                draft_seconds=draft.seconds,
                verify_seconds=verified - verify_sent,
                queue_depth=verdict.queue_depth,
                resends=draft.resends + resends,
                ssd=ssd.state,
                late_outcome=draft.late_outcome,
                fan_out=speculation.fan_out,
                branch_k=speculation.branch_k,
                branches=ssd.branches,
                speculate_seconds=ssd.seconds,
                speculate_bytes=speculation.request_bytes + ssd.bytes,
                hidden_seconds=ssd.hidden,
                seconds=time.perf_counter() - started,
                verify_forward_ms=verdict.forward_ms,
                verify_fed=fed,
                draft_forward_ms=draft.forward_ms,
                draft_fed=draft.fed,
                logprobs=verdict.logprobs if verdict.HasField("logprobs") else None,
                prompt_logprobs=(
                    verdict.prompt_logprobs if verdict.HasField("prompt_logprobs") else None
                ),
                load_level=estimate.level if estimate is not None else "",
                saturation=estimate.saturation if estimate is not None else 0.0,
                gain=estimate.gain if estimate is not None else None,
            )
            self._observe(outcome, span)
        return outcome

    def _observe(self, outcome: Outcome, span: Any) -> None:
        self._index += 1
        self.stats.observe(outcome)
        self.policy.observe(outcome)
        tracing.round_done(span, outcome)

    def _lookup(self, ctx: Sequence[int], max_k: int, remaining: int) -> Draft | None:
        """The round's lookup draft, or None when the draft model should draft (methods
        model and hybrid). A lookup draft is bounded by lookup_max_k, what is left before
        max_new_tokens and the context; the policy then sizes it (0 included), and under
        the methods with a draft model may prefer the model. A lookup method (ngram,
        suffix) that finds nothing, or whose draft the policy sizes to 0, runs the round
        without a draft."""
        lookup = self.lookup
        if lookup is None or max_k <= 0 or not lookup.active:
            return None
        bound = self._lookup_bound(ctx, remaining)
        proposal = lookup.propose(ctx, bound)
        with_model = lookup.method in (MODEL, HYBRID)
        found = proposal is not None
        if proposal is not None:
            tokens = proposal.tokens[:bound]
            if with_model and proposal.source == PREDICTION and self.tree_width > 1:
                self._prediction = tokens  # grafted onto this round's model draft
                return None
            if with_model:
                k = self.policy.lookup_or_model(proposal.source, len(tokens), max_k)
            else:
                k = self.policy.choose_lookup_k(len(tokens), proposal.source)
            if k == 0:
                proposal = None
        if proposal is None:
            if with_model:
                return None
            self._ready = None
            return Draft((), (), Source.NO_MATCH if bound > 0 and not found else Source.NO_DRAFT)
        self._ready = None  # an SSD draft prepared for this context goes unused
        late_outcome = None
        if self._late:  # the last Speculate answered after its verdict: its branches go
            # unused (a lookup drafts this round), so it missed
            self._late, late_outcome = False, Ssd.MISS
        tokens, parents, chain = self._tree(tokens[:k], proposal.others, bound, proposal.source)
        probs = () if self.greedy else [one_hot(t) for t in tokens]
        return Draft(
            tokens,
            probs,
            proposal.source,
            late_outcome=late_outcome,
            parents=parents,
            chain=chain if parents else 0,
        )

    def _tree(
        self, tokens: list[int], others: Sequence[Sequence[int]], bound: int, source: str
    ) -> tuple[list[int], list[int], int]:
        """The round's lookup draft with its source's other candidates as a token tree:
        (tokens, parents, the draft's own tokens); parents empty: a chain. The policy
        sizes the draft and each other branch (at most bound nodes in all)."""
        others = others[: self.tree_width - 1]
        if not others or not tokens:
            return tokens, [], len(tokens)
        own, share = self.policy.tree_sizes(len(tokens), len(others), bound, source)
        if share <= 0:
            return tokens[:own], [], own
        tree, parents = merge([tokens[:own], *(b[:share] for b in others)], bound)
        return (tokens[:own], [], own) if is_chain(parents) else (tree, parents, own)

    def _graft_prediction(self, ctx: Sequence[int], draft: Draft, remaining: int) -> Draft:
        """With a tree width above 1, a round where the prediction proposed tokens: the
        model's draft (a chain or the drafter's tree) with the prediction grafted on, one
        tree within the lookup bound: where they agree the nodes are the model's (drawn
        from q), where the prediction departs its tokens are one more branch (one-hot, after
        the model's). Without a model draft (k = 0, no drafter) the prediction alone."""
        prediction, self._prediction = self._prediction, None
        if not prediction:
            return draft
        if not draft.tokens:
            probs = () if self.greedy else [one_hot(t) for t in prediction]
            return Draft(
                prediction, probs, PREDICTION, draft.seconds, draft.resends, draft.late_outcome
            )
        tokens = list(draft.tokens)
        parents = list(draft.parents) if draft.parents else list(range(-1, len(tokens) - 1))
        added = graft(tokens, parents, prediction, self._lookup_bound(ctx, remaining))
        if not added:
            return draft
        more = tokens[len(draft.tokens) :]
        probs = () if self.greedy else [*draft.probs, *(one_hot(t) for t in more)]
        if is_chain(parents):  # the prediction continues the draft: a chain, as an extension
            return dataclasses.replace(
                draft, tokens=tokens, probs=probs, extended=draft.extended + added
            )
        chain = draft.chain if draft.parents else len(draft.tokens)
        return dataclasses.replace(draft, tokens=tokens, probs=probs, parents=parents, chain=chain)

    def _extend(self, ctx: Sequence[int], draft: Draft, remaining: int) -> Draft:
        """Under hybrid, the draft model's draft followed by the lookup's continuation of
        it, up to the lookup bound: free tokens, verified in the same forward, that count
        only when the whole model draft is accepted. q of each is one-hot."""
        lookup, k = self.lookup, len(draft.tokens)
        if lookup is None or lookup.method != HYBRID or k == 0 or draft.parents:
            return draft  # a tree (the drafter's alternatives) spends the bound on leaves
        more = lookup.extend(ctx, draft.tokens, self._lookup_bound(ctx, remaining) - k)
        more = more[: self.policy.choose_extension(k, len(more))]
        if not more:
            return draft
        probs = () if self.greedy else [*draft.probs, *(one_hot(t) for t in more)]
        return dataclasses.replace(
            draft, tokens=[*draft.tokens, *more], probs=probs, extended=len(more)
        )

    def _lookup_bound(self, ctx: Sequence[int], remaining: int) -> int:
        """The longest lookup draft (a model draft's extension included) this round may
        verify: lookup_max_k, what is left before max_new_tokens and the context bound
        it (the policy then chooses within it)."""
        return min(self.lookup_max_k, remaining - 1, self.max_context - len(ctx) - 1)

    async def _draft(self, ctx: Sequence[int], k: int) -> Draft:
        """The round's draft of k tokens: the one SSD prepared for exactly this context,
        else a Draft call, else (no drafter could draft) none."""
        ready, self._ready = self._ready, None
        if k == 0:
            return Draft((), (), Source.NO_DRAFT)
        if ready is not None and ready[0] == len(ctx):
            return Draft(ready[1][:k], (), Source.PREPARED)
        started = time.perf_counter()
        fed = [0]
        nodes, depth = self._tree_nodes(ctx, k)
        request = self._draft_request(k, fed, nodes, depth)
        try:
            answer = await self.caller.call(Method.DRAFT, self.drafter, ctx, request)
        except (Unavailable, UpstreamError) as e:
            answer = None
            self._lost_drafter(e)
        seconds = time.perf_counter() - started
        late_outcome = None
        if self._late:  # the last Speculate answered after its verdict: this Draft decides
            self._late = False
            late_outcome = Ssd.HIT if answer is not None and answer.response.prepared else Ssd.MISS
        if answer is None:
            return Draft((), (), Source.NO_DRAFTER, seconds, 0, late_outcome)
        self.features.delivered()
        if self._without_drafter:
            log.info("drafter back; speculation resumes", extra={"replica": self.drafter.address})
            self._without_drafter = False
        d = answer.response
        answer.replica.note_cost(d.forward_cost)
        self.fork_from.pop(Role.DRAFTER, None)
        self.drafter.answered(d.cached_length)
        source = Source.PREPARED if d.prepared else Source.DRAFTED
        leaves, depth = _leaves(d.draft_parents, k)
        return Draft(
            d.draft_tokens,
            d.draft_probs,
            source,
            seconds,
            answer.resends,
            late_outcome,
            forward_ms=d.forward_ms,
            fed=fed[0],
            parents=list(d.draft_parents),
            chain=k if d.draft_parents else 0,  # a tree's draft: its first k nodes
            leaves=leaves,
            depth=depth,
        )

    def _tree_nodes(self, ctx: Sequence[int], k: int) -> tuple[int, int]:
        """The nodes a Draft of k tokens may add as a dynamic tree and the tokens that may
        continue a leaf (DraftRequest.tree_nodes, tree_depth): (0, 0) for a chain (tree
        width 1), else what the policy sizes within the verifier's bound."""
        if self.tree_width <= 1 or k <= 0 or self.features.ask(self.drafter) is not None:
            return 0, 0  # a chain (a head drafter drafts chains only)
        bound = min(self.lookup_max_k, self.max_context - len(ctx) - 1) - k
        return self.policy.model_tree(k, self.tree_width, bound) if bound > 0 else (0, 0)

    def _constrain(self, draft: Draft) -> tuple[Draft, list[verifier_pb2.GrammarMask]]:
        """Under a grammar: the draft cut after its first forbidden token (or its end) and
        the masks of the verified positions [k+1]; without one, the draft and no masks."""
        if self.constraint is None:
            return draft, []
        cut = self.constraint.cut(draft.tokens)
        if cut.keep < len(draft.tokens):
            draft = dataclasses.replace(
                draft,
                tokens=draft.tokens[: cut.keep],
                probs=draft.probs[: cut.keep],
                extended=max(0, draft.extended - (len(draft.tokens) - cut.keep)),
            )
        return draft, cut.masks

    def _lost_drafter(self, error: Exception) -> None:
        """No drafter could draft: this round runs at k = 0 (warned once per outage, counted
        per round); speculation resumes once the probe brings a drafter back."""
        metrics.DRAFTER_FALLBACK.inc()
        self.drafter.moved(None)
        if not self._without_drafter:
            log.warning("no drafter could draft; continuing at k = 0", extra={"why": str(error)})
        self._without_drafter = True

    def _draft_request(
        self, k: int, fed: list[int] | None = None, tree_nodes: int = 0, tree_depth: int = 0
    ) -> Callable[[common_pb2.CachedPrefix, list[int]], drafter_pb2.DraftRequest]:
        def build(prefix: common_pb2.CachedPrefix, new: list[int]) -> drafter_pb2.DraftRequest:
            if fed is not None:
                fed[0] = len(new)  # the answered call's: a resend rebuilds it
            return drafter_pb2.DraftRequest(
                session_id=self.session,
                prefix=prefix,
                new_tokens=new,
                num_draft_tokens=k,
                sampling=self.sampling,
                output=self.output,
                fork_from=self._fork(Role.DRAFTER, prefix),
                tree_nodes=tree_nodes,
                tree_width=self.tree_width if tree_nodes else 0,
                tree_depth=tree_depth,
                features=self.features.for_draft(self.drafter),
            )

        return build

    def _fork(self, role: Role, prefix: common_pb2.CachedPrefix) -> str:
        """The fork_from of a call that names `prefix` (empty once a call was answered)."""
        return self.fork_from.get(role, "") if prefix.length else ""

    def _branch_k(self, draft: Draft, max_k: int) -> int:
        """The longest model draft a Speculate beside this round's Verify may prepare: as
        long as the model's part of the draft (what the next model round drafts again);
        after a lookup draft (a prediction, or a hybrid's lookup), the request's k under
        methods that fall back to the draft model; 0 under a lookup method, whose rounds
        never ask the draft model."""
        if draft.source not in LOOKUP_SOURCES:
            return len(_first_branch(draft)) - draft.extended
        return max_k if self.lookup is not None and self.lookup.method in (MODEL, HYBRID) else 0

    def _speculate(
        self, ctx: Sequence[int], draft: Sequence[int], remaining: int, max_branch_k: int
    ) -> SpeculateCall:
        """SSD's Speculate for the draft under verification (all of it: the model's tokens,
        their lookup extension, or a lookup draft), sent now; it changes no state until
        `_settle` reads it. Its branches add their next token and up to max_branch_k
        drafts after ctx + draft: they must fit the context, and the outcome "nothing
        accepted" leaves remaining - 1 tokens, room for a round of remaining - 2 drafts."""
        k = len(draft)
        branch_k = min(max_branch_k, remaining - 2, self.max_context - len(ctx) - k - 1)
        head = self.features.ask(self.drafter) is not None  # SSD with heads: not built
        if not self.ssd or k == 0 or branch_k < 1 or head:
            return SpeculateCall(Ssd.OFF)
        fan_out = self.policy.choose_fan_out(k, branch_k)
        if fan_out is None:  # the policy paused SSD: its Speculates kept arriving late
            return SpeculateCall(Ssd.PAUSED)
        speculation = SpeculateCall(Ssd.SENT, fan_out=fan_out, branch_k=branch_k)
        speculation.sent = time.perf_counter()
        speculation.task = asyncio.ensure_future(self._send_speculate(ctx, draft, speculation))
        return speculation

    async def _send_speculate(
        self, ctx: Sequence[int], draft: Sequence[int], speculation: SpeculateCall
    ) -> tuple[drafter_pb2.SpeculateResponse, Replica, float]:
        """Speculate for `speculation`'s branches; its response, the replica that answered
        and when (perf_counter seconds)."""

        def build(prefix: common_pb2.CachedPrefix, new: list[int]) -> drafter_pb2.SpeculateRequest:
            request = drafter_pb2.SpeculateRequest(
                session_id=self.session,
                prefix=prefix,
                new_tokens=new,
                draft_length=len(draft),
                num_draft_tokens=speculation.branch_k,
                sampling=self.sampling,
                output=self.output,
                fan_out=speculation.fan_out,
                # The request's own rate once it has one; until then the drafter's prior.
                acceptance_rate=self.stats.acceptance_rate if self.stats.draft_tokens else None,
            )
            speculation.request_bytes += request.ByteSize()
            return request

        # A copy of the placement: a Speculate that fails over or misses must not move
        # the Draft / Verify placement under a round in flight.
        placement = self.drafter.copy()
        answer = await self.caller.call(Method.SPECULATE, placement, ctx, build, tail=draft)
        return answer.response, answer.replica, time.perf_counter()

    async def _verify(
        self,
        ctx: Sequence[int],
        draft: Draft,
        speculation: SpeculateCall,
        masks: Sequence[verifier_pb2.GrammarMask] = (),
    ) -> tuple[verifier_pb2.VerifyResponse, int, int]:
        """The verdict on the draft, the resends it took and the tokens the answered call
        fed; a failure cancels the Speculate beside it (the verifier's error is the one
        raised)."""

        scoring = self.scoring
        prompt_logprobs = scoring.prompt_logprobs and self._index == 0
        fed = 0

        def build(prefix: common_pb2.CachedPrefix, new: list[int]) -> verifier_pb2.VerifyRequest:
            nonlocal fed
            fed = len(new) + len(draft.tokens)
            return verifier_pb2.VerifyRequest(
                session_id=self.session,
                prefix=prefix,
                new_tokens=new,
                draft_tokens=draft.tokens,
                draft_probs=draft.probs,
                sampling=self.sampling,
                output=self.output,
                logprobs=scoring.logprobs,
                top_logprobs=scoring.top_logprobs if scoring.logprobs or prompt_logprobs else 0,
                prompt_logprobs=prompt_logprobs,
                fork_from=self._fork(Role.VERIFIER, prefix),
                grammar_masks=masks,
                draft_parents=draft.parents,
                features=self.features.ask(self.drafter),
            )

        try:
            answer = await self.caller.call(Method.VERIFY, self.verifier, ctx, build)
        except BaseException:
            task = speculation.task
            if task is not None:
                task.cancel()
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: not logged as never retrieved
            raise
        verdict = answer.response
        self.features.verdict(verdict)
        answer.replica.note_cost(verdict.forward_cost)
        self.fork_from.pop(Role.VERIFIER, None)
        self.verifier.answered(verdict.cached_length)
        # The drafter cached the draft (all of it with SSD, d_1..d_{k-1} without); what
        # follows the accepted tokens is stale (a tree: what follows the path's first node
        # off the draft, Source.DRAFTED's chain).
        kept = verdict.accepted_count
        if draft.parents:
            kept = _on_chain(verdict.accepted_path, draft.chain)
        self.drafter.accepted(len(ctx) + kept)
        return verdict, answer.resends, fed

    def _settle(
        self,
        speculation: SpeculateCall,
        verdict: verifier_pb2.VerifyResponse,
        ctx: Sequence[int],
        verify_sent: float,
        verified: float,
        draft: Draft,
    ) -> SsdVerdict:
        """The round's Speculate at its verdict. Never waits and never raises: one still
        running is cancelled (late), one that failed is a miss (logged, counted). A hit
        under greedy decoding keeps the prepared draft for the next round. A tree's
        Speculate covered its first branch: a path that left it is a miss."""
        task = speculation.task
        if task is None:
            return SsdVerdict(speculation.state)
        if not task.done():
            # Cancelled, not awaited. The cancel reaches the drafter before the next Draft
            # (one connection, frames in order): a Speculate its model thread has started
            # finishes and stores its branches, and that Draft queues behind it; one not
            # started yet never runs, so it cannot overwrite the cache after that Draft.
            metrics.SSD_LATE.inc()
            task.cancel()
            self._late = True
            return SsdVerdict(Ssd.LATE, hidden=verified - verify_sent)
        if task.cancelled() or task.exception() is not None:
            why = "cancelled" if task.cancelled() else str(task.exception())
            metrics.SSD_FAILED.inc()
            log.info("speculate failed; counted as a miss", extra={"why": why})
            return SsdVerdict(Ssd.MISS)
        response, replica, answered = task.result()
        accepted, next_token = verdict.accepted_count, verdict.next_token
        outcome: tuple[int, int] | None = (accepted, next_token)
        if draft.parents:
            accepted = _on_chain(verdict.accepted_path, draft.chain)
            if accepted < verdict.accepted_count:
                outcome = None  # the path left the first branch
        if replica is self.drafter.replica:  # it holds ctx + the whole draft, of which only
            # ctx + the accepted tokens is the sequence: a call naming more would miss
            self.drafter.answered(response.cached_length)
            self.drafter.accepted(len(ctx) + accepted)
        branch = next(
            (b for b in response.branches if (b.accepted_count, b.next_token) == outcome),
            None,
        )
        if branch is not None and self.greedy:  # sampling fetches it from the drafter,
            # with its distributions (a Draft without a forward)
            self._ready = (len(ctx) + accepted + 1, list(branch.draft_tokens))
        elif outcome is None and self.greedy:
            branch = self._through_leaf(response, verdict, draft, accepted)
            if branch is not None:  # its draft after the leaf began with the rest of the
                # path (a continued leaf's) and the next token
                after = len(verdict.accepted_path) - accepted
                self._ready = (
                    len(ctx) + len(verdict.accepted_path) + 1,
                    list(branch.draft_tokens[after:]),
                )
        return SsdVerdict(
            Ssd.HIT if branch is not None else Ssd.MISS,
            branches=len(response.branches),
            seconds=answered - speculation.sent,
            bytes=response.ByteSize(),
            hidden=max(0.0, min(answered, verified) - max(speculation.sent, verify_sent)),
        )

    @staticmethod
    def _through_leaf(
        response: drafter_pb2.SpeculateResponse,
        verdict: verifier_pb2.VerifyResponse,
        draft: Draft,
        on_chain: int,
    ) -> drafter_pb2.SpeculatedBranch | None:
        """Under greedy decoding, a tree path that left the first branch at one leaf x (after
        on_chain of its tokens), then took x's continuation c_1..c_j (j >= 0, a continued
        leaf's) and emitted y: the branch SSD prepared for "on_chain accepted, then x" whose
        draft starts with c_1..c_j y (its rest is the drafter's greedy draft after y) and
        whose rest is at least as long as after a terminal leaf (k - 1: a shorter one would
        cost the next round more tokens than the Draft it spares), or None."""
        path = verdict.accepted_path
        if len(path) <= on_chain:
            return None
        leaf = draft.tokens[path[on_chain]]
        rest = [*(draft.tokens[i] for i in path[on_chain + 1 :]), verdict.next_token]
        return next(
            (
                b
                for b in response.branches
                if (b.accepted_count, b.next_token) == (on_chain, leaf)
                and len(b.draft_tokens) - len(rest) >= max(1, draft.chain - 1)
                and list(b.draft_tokens[: len(rest)]) == rest
            ),
            None,
        )


def _path_first(tokens: Sequence[int], path: Sequence[int]) -> tuple[int, ...]:
    """A draft's tokens with a tree's accepted path first (a chain's as they are)."""
    if not path:
        return tuple(tokens)
    on = set(path)
    return (*(tokens[i] for i in path), *(t for i, t in enumerate(tokens) if i not in on))


def _leaves(parents: Sequence[int], chain: int) -> tuple[int, int]:
    """A drafter's tree (its first `chain` nodes the draft, then its leaves, then their
    continuations): (its leaves, the longest continuation below one)."""
    depth = [0] * len(parents)
    leaves = 0
    for i in range(chain, len(parents)):
        if parents[i] < chain:
            leaves += 1
        else:
            depth[i] = depth[parents[i]] + 1
    return leaves, max(depth, default=0)


def _width(parents: Sequence[int]) -> int:
    """Branches at a tree's root (1: a chain)."""
    return sum(p == -1 for p in parents) if parents else 1


def _first_branch(draft: Draft) -> Sequence[int]:
    """The draft a chain would be: a tree's first branch (its first nodes), a chain whole."""
    return draft.tokens[: draft.chain] if draft.parents else draft.tokens


def _on_chain(path: Sequence[int], chain: int) -> int:
    """The accepted path's nodes on a tree's first branch (nodes 0..chain-1, a chain)."""
    n = 0
    while n < len(path) and n < chain and path[n] == n:
        n += 1
    return n


def _branch(parents: Sequence[int], path: Sequence[int], chain: int = 0) -> int | None:
    """Which branch the accepted path took: 0 the first (the chain's own draft, the first
    `chain` nodes of a tree), else the index of its root branch, or 1 when it left the
    first branch below the root; None when nothing was accepted."""
    if not path:
        return None
    if not parents or _on_chain(path, chain) == len(path):
        return 0
    return [i for i, p in enumerate(parents) if p == -1].index(path[0]) or 1
