"""Where a round's draft comes from: `Drafts`, one request's, each round's a `Draft`.

The draft model's (a `Draft` call, or the draft SSD prepared for exactly this context),
or the request's lookup proposer's (specdec.gateway.round.lookup: prompt lookup, suffix
decoding, a prediction), built from the token ids the gateway holds, without a drafter
call; under hybrid, prompt lookup also extends the drafter's draft in the same round
(`Drafts.extend`). A lookup draft's distribution is one-hot, so under sampling it travels
as SparseProbs(token_ids=[d], probs=[1.0]) and the verifier's rule accepts d with
probability p(d) and recovers from p without d. Losing every drafter degrades a round to
k = 0 (the same output, slower); it never fails a request.

With a tree width above 1 (SpeculationParams.tree_width) a lookup round verifies its
source's other candidate continuations beside its draft, as one token tree
(specdec.gateway.round.tree): the draft is the first branch, cut to the length the policy
chose; each other branch starts with another token and gets an equal share of what the
policy sizes for them (`Policy.tree_sizes`). The draft model's rounds grow a dynamic tree
on the drafter (DraftRequest.tree_nodes: its top alternatives to the draft's tokens as
leaves, the best continued by more drafter forwards (tree_depth), sized by
`Policy.model_tree`), and a prediction is grafted onto the model's draft
(`Drafts.graft_prediction`). A request with logits processors that read the sequence, a
grammar or logprobs verifies chains only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.common.errors import Unavailable
from specdec.gateway.fleet.caller import UpstreamError
from specdec.gateway.names import Role, Source, Ssd
from specdec.gateway.observe import metrics
from specdec.gateway.round.calls import DraftAsk, RoundCalls
from specdec.gateway.round.grammar import Constraint
from specdec.gateway.round.lookup import HYBRID, MODEL, PREDICTION
from specdec.gateway.round.lookup.hybrid import RequestLookup
from specdec.gateway.round.policy import Policy
from specdec.gateway.round.policy.prices import MAX_FED
from specdec.gateway.round.ssd import SsdBranches
from specdec.gateway.round.tree import DraftTree
from specdec.v1 import common_pb2, verifier_pb2

log = logging.getLogger(__name__)

# A plain round (the goodput guard's) feeds the drafter once it lags this many tokens.
FEED_LAG = 16


@dataclass(frozen=True, slots=True)
class Draft:
    """A round's draft and where it came from."""

    tree: DraftTree  # its tokens [k]: a chain, or a token tree's nodes
    probs: Sequence[common_pb2.DraftDistribution]  # [k] under sampling, else empty
    source: Source
    seconds: float = 0.0  # the gateway's wait for its Draft call
    resends: int = 0
    late_outcome: Ssd | None = None  # the previous round's late Speculate, decided now
    extended: int = 0  # lookup tokens appended to the draft model's draft (hybrid)
    forward_ms: float = 0.0  # the Draft's forwards, as the drafter reported them
    fed: int = 0  # tokens the Draft call fed (its new tokens: a prefill or resend is long)
    leaves: int = 0  # the drafter's tree: its alternatives to the draft's tokens
    depth: int = 0  # the drafter's tree: the forwards that continued its leaves

    @property
    def tokens(self) -> tuple[int, ...]:  # [k]
        return self.tree.tokens


NO_DRAFT = Draft(DraftTree(), (), Source.NO_DRAFT)


def one_hot(token: int) -> common_pb2.DraftDistribution:
    """The proposal distribution of a deterministic (lookup) draft token."""
    return common_pb2.DraftDistribution(
        sparse=common_pb2.SparseProbs(token_ids=[token], probs=[1.0])
    )


def constrained(
    draft: Draft, constraint: Constraint | None
) -> tuple[Draft, list[verifier_pb2.GrammarMask]]:
    """Under a grammar: the draft cut after its first forbidden token (or its end) and
    the masks of the verified positions [k+1]; without one, the draft and no masks."""
    if constraint is None:
        return draft, []
    cut = constraint.cut(draft.tokens)
    if cut.keep < len(draft.tokens):
        draft = dataclasses.replace(
            draft,
            tree=draft.tree.cut(cut.keep),
            probs=draft.probs[: cut.keep],
            extended=max(0, draft.extended - (len(draft.tokens) - cut.keep)),
        )
    return draft, cut.masks


class Drafts:
    """One request's drafts, round after round: its lookup proposer, the draft model
    through its calls, and SSD's prepared drafts."""

    def __init__(
        self,
        calls: RoundCalls,
        ssd: SsdBranches,
        policy: Policy,
        *,
        lookup: RequestLookup | None,
        lookup_max_k: int,
        max_context: int,
        tree_width: int,
        greedy: bool,
    ):
        self.calls = calls
        self.ssd = ssd
        self.policy = policy
        self.lookup = lookup  # the request's lookup proposer (None: the draft model alone)
        self.lookup_max_k = lookup_max_k  # bound of a lookup draft (the replicas' largest k)
        self.max_context = max_context
        self.tree_width = tree_width  # candidate continuations per round (1: chains)
        self.greedy = greedy
        self._prediction: list[int] | None = None  # to graft onto this round's model draft
        self._without_drafter = False  # the last Draft found no drafter
        self._prefill: asyncio.Task[None] | None = None  # the drafter's, beside a Verify

    def _one_hot(self, tokens: Sequence[int]) -> Sequence[common_pb2.DraftDistribution]:
        """A lookup draft's proposal distributions: none under greedy decoding."""
        return () if self.greedy else [one_hot(t) for t in tokens]

    def bound(self, ctx: Sequence[int], remaining: int) -> int:
        """The longest lookup draft (a model draft's extension included) this round may
        verify: lookup_max_k, what is left before max_new_tokens and the context bound
        it (the policy then chooses within it)."""
        return min(self.lookup_max_k, remaining - 1, self.max_context - len(ctx) - 1)

    def lookup_draft(self, ctx: Sequence[int], max_k: int, remaining: int) -> Draft | None:
        """The round's lookup draft, or None when the draft model should draft (methods
        model and hybrid). A lookup draft is bounded by `bound`; the policy then sizes it
        (0 included), and under the methods with a draft model may prefer the model. A
        lookup method (ngram, suffix) that finds nothing, or whose draft the policy sizes
        to 0, runs the round without a draft."""
        lookup = self.lookup
        if lookup is None or max_k <= 0 or not lookup.active:
            return None
        bound = self.bound(ctx, remaining)
        proposal = lookup.propose(ctx, bound)
        with_model = lookup.method in (MODEL, HYBRID)
        found = proposal is not None
        k = 0
        tokens: list[int] = []
        if proposal is not None:
            tokens = proposal.tokens[:bound]
            if with_model and proposal.source == PREDICTION and self.tree_width > 1:
                self._prediction = tokens  # grafted onto this round's model draft
                return None
            if with_model:
                k = self.policy.lookup_or_model(proposal.source, len(tokens), max_k)
            else:
                k = self.policy.choose_lookup_k(len(tokens), proposal.source)
        if proposal is None or k == 0:
            if with_model:
                return None
            self.ssd.drop_prepared()
            return Draft(
                DraftTree(), (), Source.NO_MATCH if bound > 0 and not found else Source.NO_DRAFT
            )
        self.ssd.drop_prepared()  # an SSD draft prepared for this context goes unused
        # The last Speculate answered after its verdict: its branches go unused (a lookup
        # drafts this round), so it missed.
        late_outcome = self.ssd.late_outcome(prepared=False)
        tree = self._lookup_tree(tokens[:k], proposal.others, bound, proposal.source)
        return Draft(tree, self._one_hot(tree.tokens), proposal.source, late_outcome=late_outcome)

    def _lookup_tree(
        self, tokens: list[int], others: Sequence[Sequence[int]], bound: int, source: str
    ) -> DraftTree:
        """The round's lookup draft with its source's other candidates as a token tree (a
        chain without them). The policy sizes the draft and each other branch (at most
        bound nodes in all)."""
        others = others[: self.tree_width - 1]
        if not others or not tokens:
            return DraftTree(tuple(tokens))
        own, share = self.policy.tree_sizes(len(tokens), len(others), bound, source)
        if share <= 0:
            return DraftTree(tuple(tokens[:own]))
        tree = DraftTree.merge([tokens[:own], *(b[:share] for b in others)], bound)
        return DraftTree(tuple(tokens[:own])) if tree.is_chain else tree

    def prefill_beside(self, ctx: Sequence[int], first: bool) -> bool:
        """Whether the drafter prefills beside this round's Verify (then started), so the
        round drafts nothing from the model: under a policy that does so (the adaptive
        one), in a turn's first round (`first`) when the drafter holds nothing of the
        request or lacks more than MAX_FED tokens of it (a long new message). Drafting
        first would keep the verifier waiting for the drafter's queue, its prefill and its
        draft before it starts on the prompt; beside the verifier's prefill, the drafter's
        costs the round nothing, and the next round's Draft feeds only what followed. Not
        for a head drafter (it needs the verifier's features of those tokens), a fork (n >
        1: the cache is copied, not computed) or while no drafter answers."""
        cached = self.calls.drafter.cached
        if not first or (cached > 0 and len(ctx) - cached <= MAX_FED):
            return False
        return self._start_prefill(ctx)

    def feed_beside(self, ctx: Sequence[int], remaining: int) -> None:
        """In a plain round (the goodput guard's epoch without speculation): keep the
        drafter within FEED_LAG tokens of the sequence, beside the Verify, so that when
        speculation resumes the request's first Draft feeds a few tokens, not everything
        the plain rounds committed (the drafter's core is idle meanwhile). Never awaited
        here: while the last feed is in flight the round sends none; nor near the
        request's end (`remaining` within FEED_LAG), where a feed would only delay its
        last event (`drafter_ready`)."""
        task = self._prefill
        if task is not None:
            if not task.done():
                return
            self._prefill = None
            task.result()  # its drafter's failures are handled in it; anything else raises
        lag = len(ctx) - self.calls.drafter.cached
        if lag >= FEED_LAG and remaining > FEED_LAG:
            self._start_prefill(ctx)

    def _start_prefill(self, ctx: Sequence[int]) -> bool:
        """Start the drafter's prefill of ctx beside the round's Verify, unless the
        request's policy drafts every round anyway, one is in flight, no drafter answers,
        the drafter's cache is a fork's or a head drafter needs the verifier's features."""
        calls = self.calls
        if (
            not self.policy.prefills_beside
            or self._prefill is not None
            or self._without_drafter
            or Role.DRAFTER in calls.fork_from
            or calls.features.ask(calls.drafter) is not None
        ):
            return False
        self._prefill = asyncio.ensure_future(self._prefill_drafter(tuple(ctx)))
        return True

    async def _prefill_drafter(self, ctx: Sequence[int]) -> None:
        """A Draft of one token after ctx (the least a Draft asks), which is not used: the
        drafter's cache then holds ctx, and the next Draft feeds only what follows."""
        try:
            await self.calls.draft(ctx, DraftAsk(1))
        except (Unavailable, UpstreamError) as e:
            self._lost_drafter(e)
        self.calls.drafter.accepted(len(ctx))  # its draft token is not the sequence's

    async def drafter_ready(self) -> None:
        """Wait for the drafter's prefill, if one is in flight: the next call to the
        drafter names what it cached."""
        task, self._prefill = self._prefill, None
        if task is not None:
            await task

    async def model_draft(self, ctx: Sequence[int], k: int) -> Draft:
        """The round's draft of k tokens: the one SSD prepared for exactly this context,
        else a Draft call, else (no drafter could draft) none."""
        ready = self.ssd.take_prepared(len(ctx))
        if k == 0:
            return NO_DRAFT
        if ready is not None:
            return Draft(DraftTree(tuple(ready[:k])), (), Source.PREPARED)
        started = time.perf_counter()
        nodes, depth = self._tree_nodes(ctx, k)
        try:
            d, resends, fed = await self.calls.draft(
                ctx, DraftAsk(k, nodes, depth, self.tree_width)
            )
        except (Unavailable, UpstreamError) as e:
            self._lost_drafter(e)
            seconds = time.perf_counter() - started
            late = self.ssd.late_outcome(prepared=False)
            return Draft(DraftTree(), (), Source.NO_DRAFTER, seconds, 0, late)
        seconds = time.perf_counter() - started
        late = self.ssd.late_outcome(prepared=d.prepared)  # this Draft decides it
        if self._without_drafter:
            log.info(
                "drafter back; speculation resumes", extra={"replica": self.calls.drafter.address}
            )
            self._without_drafter = False
        tree = DraftTree.of(d.draft_tokens, d.draft_parents, k)  # a tree's draft: its first k nodes
        leaves, depth = tree.leaves()
        return Draft(
            tree,
            d.draft_probs,
            Source.PREPARED if d.prepared else Source.DRAFTED,
            seconds,
            resends,
            late,
            forward_ms=d.forward_ms,
            fed=fed,
            leaves=leaves,
            depth=depth,
        )

    def _tree_nodes(self, ctx: Sequence[int], k: int) -> tuple[int, int]:
        """The nodes a Draft of k tokens may add as a dynamic tree and the tokens that may
        continue a leaf (DraftRequest.tree_nodes, tree_depth): (0, 0) for a chain (tree
        width 1), else what the policy sizes within the verifier's bound."""
        if self.tree_width <= 1 or k <= 0:
            return 0, 0  # a chain
        bound = min(self.lookup_max_k, self.max_context - len(ctx) - 1) - k
        return self.policy.model_tree(k, self.tree_width, bound) if bound > 0 else (0, 0)

    def _lost_drafter(self, error: Exception) -> None:
        """No drafter could draft: this round runs at k = 0 (warned once per outage, counted
        per round); speculation resumes once the probe brings a drafter back."""
        metrics.DRAFTER_FALLBACK.inc()
        self.calls.drafter.moved(None)
        if not self._without_drafter:
            log.warning("no drafter could draft; continuing at k = 0", extra={"why": str(error)})
        self._without_drafter = True

    def extend(self, ctx: Sequence[int], draft: Draft, remaining: int) -> Draft:
        """Under hybrid, the draft model's draft followed by the lookup's continuation of
        it, up to the lookup bound: free tokens, verified in the same forward, that count
        only when the whole model draft is accepted. q of each is one-hot."""
        lookup, k = self.lookup, len(draft.tokens)
        if lookup is None or lookup.method != HYBRID or k == 0 or not draft.tree.is_chain:
            return draft  # a tree (the drafter's alternatives) spends the bound on leaves
        more = lookup.extend(ctx, draft.tokens, self.bound(ctx, remaining) - k)
        more = more[: self.policy.choose_extension(k, len(more))]
        if not more:
            return draft
        probs = () if self.greedy else [*draft.probs, *(one_hot(t) for t in more)]
        tree = DraftTree((*draft.tokens, *more))
        return dataclasses.replace(draft, tree=tree, probs=probs, extended=len(more))

    def graft_prediction(self, ctx: Sequence[int], draft: Draft, remaining: int) -> Draft:
        """With a tree width above 1, a round where the prediction proposed tokens: the
        model's draft (a chain or the drafter's tree) with the prediction grafted on, one
        tree within the lookup bound: where they agree the nodes are the model's (drawn
        from q), where the prediction departs its tokens are one more branch (one-hot, after
        the model's). Without a model draft (k = 0, no drafter) the prediction alone."""
        prediction, self._prediction = self._prediction, None
        if not prediction:
            return draft
        if not draft.tokens:
            return Draft(
                DraftTree(tuple(prediction)),
                self._one_hot(prediction),
                PREDICTION,
                draft.seconds,
                draft.resends,
                draft.late_outcome,
            )
        tree = draft.tree.graft(prediction, self.bound(ctx, remaining))
        added = len(tree.tokens) - len(draft.tokens)
        if not added:
            return draft
        more = tree.tokens[len(draft.tokens) :]
        probs = () if self.greedy else [*draft.probs, *(one_hot(t) for t in more)]
        if tree.is_chain:  # the prediction continues the draft: a chain, as an extension
            return dataclasses.replace(
                draft, tree=tree, probs=probs, extended=draft.extended + added
            )
        return dataclasses.replace(draft, tree=tree, probs=probs)
