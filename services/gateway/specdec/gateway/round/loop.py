"""The speculation loop of DESIGN §2 as the gateway runs it, one request at a time.

A round (`Speculator.round`, on one screen): the draft (specdec.gateway.round.draft: a
lookup's, a `Draft` on a drafter, a draft SSD prepared, or none), SSD's `Speculate` beside
the `Verify` when SSD is on (specdec.gateway.round.ssd), the verdict. It returns one
frozen `Outcome` (specdec.gateway.outcome) and keeps no books: the request's statistics,
the k policy and the round's span observe the outcome. The calls go through the request's
`ReplicaCaller` (specdec.gateway.fleet.caller, specdec.gateway.round.calls), which names
the cached prefix of each call and absorbs cache misses, busy replicas and failover;
misses and failover cost time, never tokens.

The verifier applies the same rule to whatever draft it gets (a chain, or a token tree:
specdec.gateway.round.tree), so SSD, lookup drafts and trees change speed only, never
tokens. The verdict's accepted path is the round's accepted tokens.

A lookup method (ngram, suffix) never asks the drafter: its rounds send no Speculate, and
the drafter's cache stays behind; a later Draft names the prefix it still holds and sends
what follows (`new_tokens`), as after any other gap. Under hybrid the next round may fall
back to the draft model, so with SSD every hybrid round's Speculate covers the whole draft
under verification (a lookup draft, or the model's draft and its extension) and prepares
the model's next draft for its likeliest outcomes, on the drafter's otherwise idle core.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from specdec.common.controls import Controls, processes_logits
from specdec.gateway.job import NO_SCORING, ResolvedSpeculation
from specdec.gateway.names import LOOKUP_SOURCES, KPolicy, Role, Ssd
from specdec.gateway.observe import tracing
from specdec.gateway.outcome import Outcome, RequestStats
from specdec.gateway.round.calls import RoundCalls, Verdict
from specdec.gateway.round.draft import Draft, Drafts, constrained
from specdec.gateway.round.grammar import Constraint
from specdec.gateway.round.lookup import HYBRID, MODEL
from specdec.gateway.round.lookup.hybrid import RequestLookup
from specdec.gateway.round.policy import GuardMode, Policy, RoundGuard
from specdec.gateway.round.ssd import SsdBranches, SsdCall, SsdVerdict
from specdec.sdk.request import Scoring


class Speculator:
    """Runs the rounds of one request."""

    def __init__(
        self,
        calls: RoundCalls,
        policy: Policy,
        *,
        greedy: bool,
        processors: Controls,
        speculation: ResolvedSpeculation,
        scoring: Scoring = NO_SCORING,
        max_context: int,
        lookup_max_k: int = 0,
        constraint: Constraint | None = None,
        lookup: RequestLookup | None = None,
        guard: RoundGuard | None = None,
    ):
        """One request's rounds through `calls` (its placements, and the sampling and
        output controls every call carries): whether its sampling is `greedy` and its
        logits `processors`, `speculation` (its SSD and tree width; the k of each round
        is the turn's, `round`'s max_k), `scoring` (what each Verify scores: the prompt
        with the first round's), the context bound and the largest lookup draft (the
        replicas' largest k), the grammar state, the lookup proposer and the gateway's
        goodput guard (an adaptive request's: which epochs speculate)."""
        self.calls = calls
        drafter, verifier, caller = calls.drafter, calls.verifier, calls.caller
        self.drafter = drafter
        self.verifier = verifier
        # n > 1 (specdec.gateway.front.choices): per role, the replica session whose cache the
        # next call that names a prefix starts from (VerifyRequest.fork_from).
        self.fork_from: dict[Role, str] = self.calls.fork_from
        self.policy = policy
        policy.bind(drafter, verifier, caller.fleet)  # it prices drafts with their cost curves
        # Structured output: the request's grammar state, advanced by its turn
        # (specdec.gateway.round.grammar); it cuts each draft and masks each verified position.
        self.constraint = constraint
        self.lookup = lookup  # the request's lookup proposer (None: the draft model alone)
        # Candidate continuations a round verifies as a tree (1: a chain); what the
        # verifier cannot score on a tree yet keeps chains.
        tree_ok = not (
            constraint is not None
            or scoring.logprobs
            or scoring.prompt_logprobs
            or processes_logits(processors, calls.output)
        )
        self.tree_width = speculation.tree_width if tree_ok else 1
        self.stats = RequestStats(adaptive=policy.kind == KPolicy.ADAPTIVE)
        self.ssd = SsdBranches(
            self.calls,
            policy,
            self.stats,
            enabled=speculation.ssd,
            greedy=greedy,
            max_context=max_context,
        )
        self.drafts = Drafts(
            self.calls,
            self.ssd,
            policy,
            lookup=lookup,
            lookup_max_k=lookup_max_k,
            max_context=max_context,
            tree_width=self.tree_width,
            greedy=greedy,
        )
        # Scores asked of each Verify (with top_logprobs alternatives per token); the
        # prompt's with the first round's.
        self.scoring = scoring
        self.guard = guard
        self._index = 0

    async def round(self, ctx: Sequence[int], max_k: int, remaining: int) -> Outcome:
        """One round after ctx, drafting at most max_k tokens (the policy picks k); with SSD
        a Speculate only when some outcome leaves room (`remaining` tokens may still be
        generated, >= max_k + 1) for another round with a draft."""
        started = time.perf_counter()
        self.policy.estimate = None  # what this round's decisions price (Outcome.gain)
        ticket = self.guard.begin(id(self)) if self.guard is not None else None
        plain = ticket is not None and ticket.mode == GuardMode.PLAIN
        max_k = 0 if plain else max_k  # the guard's epoch runs plain target steps
        drafts = self.drafts
        with tracing.round_span(self._index) as span:
            if plain:  # the drafter keeps up beside plain steps, never awaited
                drafts.feed_beside(ctx, remaining)
            else:
                await drafts.drafter_ready()  # a prefill beside the last Verify has answered
            # The draft: a lookup's (the policy sizes it, or prefers the model), else the
            # draft model's k tokens (the policy's choice: a Draft, or what SSD prepared),
            # which hybrid extends by lookup and a prediction may graft a branch onto.
            draft = drafts.lookup_draft(ctx, max_k, remaining)
            # A drafter without the prompt prefills it beside this round's Verify.
            prefilling = not plain and drafts.prefill_beside(ctx, first=self._index == 0)
            if draft is None:
                # That round drafts nothing, as a head drafter's first, which waits for
                # the prompt's features.
                waits = prefilling or self.calls.features.awaits_prompt(self.drafter)
                k = 0 if waits else self.policy.choose_k(max_k)
                draft = await drafts.model_draft(ctx, k)
                draft = drafts.extend(ctx, draft, remaining)
                draft = drafts.graft_prediction(ctx, draft, remaining)
            # A grammar cuts the draft at its first forbidden token and masks each position.
            draft, masks = constrained(draft, self.constraint)

            # SSD's Speculate leaves beside the Verify, for the outcomes of the draft's
            # first branch; it changes nothing until the verdict settles it.
            first = draft.tree.first_branch
            branch_k = 0 if prefilling else self._branch_k(draft, max_k)  # 0: no Speculate
            speculation = self.ssd.send(ctx, first, remaining, branch_k)
            try:
                verdict = await self.calls.verify(
                    ctx, draft.tree, draft.probs, self._scoring(), masks
                )
            except BaseException:
                speculation.cancel()  # the verifier's error is the one raised
                raise
            ssd = self.ssd.settle(speculation, verdict, len(ctx), draft.tree)
            if ssd.state == Ssd.LATE:
                await asyncio.sleep(0)  # the cancel leaves before the next drafter call

            # The outcome, observed by the request's statistics, the policy and the span.
            outcome = self._outcome(max_k, draft, verdict, speculation, ssd, started)
            self._index += 1
            self.stats.observe(outcome)
            self.policy.observe(outcome)
            if ticket is not None and self.guard is not None:
                self.guard.end(id(self), ticket, len(outcome.tokens), outcome.seconds)
            tracing.round_done(span, outcome)
        return outcome

    def leave(self) -> None:
        """The request runs no more rounds (done, failed or cancelled): the goodput guard
        awaits none of it."""
        if self.guard is not None:
            self.guard.leave(id(self))

    async def idle(self) -> None:
        """Once the request's last round is done: wait for a drafter prefill still in
        flight (a request that ended in its first round), so that nothing of the request
        reaches its replicas after it (a release of its caches, say)."""
        await self.drafts.drafter_ready()

    def _scoring(self) -> Scoring:
        """What this round's Verify scores: the request's, the prompt's with the first
        round's only, alternatives when either is asked."""
        scoring = self.scoring
        prompt = scoring.prompt_logprobs and self._index == 0
        top = scoring.top_logprobs if scoring.logprobs or prompt else 0
        return Scoring(logprobs=scoring.logprobs, top_logprobs=top, prompt_logprobs=prompt)

    def _branch_k(self, draft: Draft, max_k: int) -> int:
        """The longest model draft a Speculate beside this round's Verify may prepare: as
        long as the model's part of the draft (what the next model round drafts again);
        after a lookup draft (a prediction, or a hybrid's lookup), the request's k under
        methods that fall back to the draft model; 0 under a lookup method, whose rounds
        never ask the draft model."""
        if draft.source not in LOOKUP_SOURCES:
            return len(draft.tree.first_branch) - draft.extended
        return max_k if self.lookup is not None and self.lookup.method in (MODEL, HYBRID) else 0

    def _outcome(
        self,
        max_k: int,
        draft: Draft,
        verdict: Verdict,
        speculation: SsdCall,
        ssd: SsdVerdict,
        started: float,
    ) -> Outcome:
        """The round's record: its draft (a tree's accepted path first), the verdict, what
        SSD did, and what each step cost (`started`: when the round began)."""
        tree, verified = draft.tree, verdict.response
        path = verified.accepted_path
        estimate = self.policy.estimate
        return Outcome(
            index=self._index,
            max_k=max_k,
            k=len(tree.tokens),
            draft=tree.path_first(path),
            width=tree.width,
            branch=tree.branch(path),
            chain=tree.chain,
            on_chain=tree.on_chain(path),
            tree_leaves=draft.leaves,
            tree_depth=draft.depth,
            extended=draft.extended,
            accepted=verified.accepted_count,
            next_token=verified.next_token,
            source=draft.source,
            draft_seconds=draft.seconds,
            verify_seconds=verdict.seconds,
            queue_depth=verified.queue_depth,
            resends=draft.resends + verdict.resends,
            ssd=ssd.state,
            late_outcome=draft.late_outcome,
            fan_out=speculation.fan_out,
            branch_k=speculation.branch_k,
            branches=ssd.branches,
            speculate_seconds=ssd.seconds,
            speculate_bytes=speculation.request_bytes + ssd.bytes,
            feature_bytes=len(verified.features.data),
            hidden_seconds=ssd.hidden,
            seconds=time.perf_counter() - started,
            verify_forward_ms=verified.forward_ms,
            verify_fed=verdict.fed,
            draft_forward_ms=draft.forward_ms,
            draft_fed=draft.fed,
            logprobs=verified.logprobs if verified.HasField("logprobs") else None,
            prompt_logprobs=(
                verified.prompt_logprobs if verified.HasField("prompt_logprobs") else None
            ),
            load_level=estimate.level if estimate is not None else "",
            saturation=estimate.saturation if estimate is not None else 0.0,
            gain=estimate.gain if estimate is not None else None,
        )
