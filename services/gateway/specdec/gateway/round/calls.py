"""A request's calls of a round: `Draft` and `Verify` (SSD's `Speculate` is in
specdec.gateway.round.ssd).

Each goes through the request's `ReplicaCaller` (specdec.gateway.fleet.caller), which
names the cached prefix it builds on and absorbs cache misses, busy replicas and failover;
each carries the request's sampling and output controls in their wire form (SSD's
`Speculate` too). Here each
request is built from the prefix the caller names, and an answered Draft or Verify moves
the placements: what the replica caches now, what a verdict made stale, the features a
head drafter gets next, and n > 1's forks (`fork_from`, specdec.gateway.front.choices: a
choice's first Draft and Verify start from choice 0's cache).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.gateway.fleet.caller import Placement, ReplicaCaller
from specdec.gateway.fleet.transport import Method
from specdec.gateway.names import Role
from specdec.gateway.round.features import FeatureRelay
from specdec.gateway.round.tree import DraftTree
from specdec.sdk.request import Scoring
from specdec.v1 import common_pb2, drafter_pb2, verifier_pb2


@dataclass(frozen=True, slots=True)
class DraftAsk:
    """What a round asks of the drafter: k tokens, and a dynamic tree's nodes and depth
    (DraftRequest.tree_nodes, tree_depth; 0: a chain) at the request's tree width."""

    k: int
    tree_nodes: int = 0
    tree_depth: int = 0
    tree_width: int = 1


@dataclass(frozen=True, slots=True)
class Verdict:
    """A Verify's answer: the verifier's response, the full-context resends it took, the
    tokens the answered call fed (new tokens and the draft), and when it left and
    answered (perf_counter seconds)."""

    response: verifier_pb2.VerifyResponse
    resends: int
    fed: int
    sent: float
    answered: float

    @property
    def seconds(self) -> float:
        return self.answered - self.sent


@dataclass
class RoundCalls:
    """One request's calls to its drafter and verifier placements: each carries the
    request's sampling and its output controls in their wire form (where the request's
    output starts and its min_tokens mask: the logits processors need both)."""

    caller: ReplicaCaller
    session: str  # the replica session
    sampling: common_pb2.SamplingParams
    output: common_pb2.OutputControls | None
    drafter: Placement
    verifier: Placement
    # n > 1 (specdec.gateway.front.choices): per role, the replica session whose cache the
    # next call that names a prefix starts from (VerifyRequest.fork_from).
    fork_from: dict[Role, str] = field(default_factory=dict)
    features: FeatureRelay = field(init=False)  # a head drafter's, verifier to drafter

    def __post_init__(self) -> None:
        self.features = FeatureRelay(self.caller.fleet)

    def _fork(self, role: Role, prefix: common_pb2.CachedPrefix) -> str:
        """The fork_from of a call that names `prefix` (empty once a call was answered)."""
        return self.fork_from.get(role, "") if prefix.length else ""

    async def draft(
        self, ctx: Sequence[int], ask: DraftAsk
    ) -> tuple[drafter_pb2.DraftResponse, int, int]:
        """A Draft after ctx: its response, the full-context resends it took and the tokens
        the answered call fed (its new tokens: a prefill or resend is long). Raises what
        the caller raises."""
        fed = 0

        def build(prefix: common_pb2.CachedPrefix, new: list[int]) -> drafter_pb2.DraftRequest:
            nonlocal fed
            fed = len(new)  # the answered call's: a resend rebuilds it
            return drafter_pb2.DraftRequest(
                session_id=self.session,
                prefix=prefix,
                new_tokens=new,
                num_draft_tokens=ask.k,
                sampling=self.sampling,
                output=self.output,
                fork_from=self._fork(Role.DRAFTER, prefix),
                tree_nodes=ask.tree_nodes,
                tree_width=ask.tree_width if ask.tree_nodes else 0,
                tree_depth=ask.tree_depth,
                features=self.features.for_draft(self.drafter),
            )

        answer = await self.caller.call(Method.DRAFT, self.drafter, ctx, build)
        self.features.delivered()
        response: drafter_pb2.DraftResponse = answer.response
        answer.replica.note_cost(response.forward_cost)
        self.fork_from.pop(Role.DRAFTER, None)
        self.drafter.answered(response.cached_length)
        return response, answer.resends, fed

    async def verify(
        self,
        ctx: Sequence[int],
        tokens: DraftTree,
        probs: Sequence[common_pb2.DraftDistribution],
        scoring: Scoring,
        masks: Sequence[verifier_pb2.GrammarMask] = (),
    ) -> Verdict:
        """The verdict on the draft after ctx (`scoring`: the scores it asks). The drafter
        cached the draft (all of it with SSD, d_1..d_{k-1} without); what follows the
        accepted tokens is stale (a tree: what follows the path's first node off the
        draft, its first branch)."""
        sent = time.perf_counter()
        fed = 0

        def build(prefix: common_pb2.CachedPrefix, new: list[int]) -> verifier_pb2.VerifyRequest:
            nonlocal fed
            fed = len(new) + len(tokens.tokens)
            return verifier_pb2.VerifyRequest(
                session_id=self.session,
                prefix=prefix,
                new_tokens=new,
                draft_tokens=tokens.tokens,
                draft_probs=probs,
                sampling=self.sampling,
                output=self.output,
                logprobs=scoring.logprobs,
                top_logprobs=scoring.top_logprobs,
                prompt_logprobs=scoring.prompt_logprobs,
                fork_from=self._fork(Role.VERIFIER, prefix),
                grammar_masks=masks,
                draft_parents=tokens.parents,
                features=self.features.ask(self.drafter),
            )

        answer = await self.caller.call(Method.VERIFY, self.verifier, ctx, build)
        verdict: verifier_pb2.VerifyResponse = answer.response
        self.features.verdict(verdict)
        answer.replica.note_cost(verdict.forward_cost)
        self.fork_from.pop(Role.VERIFIER, None)
        self.verifier.answered(verdict.cached_length)
        kept = tokens.accepted_on_chain(verdict.accepted_count, verdict.accepted_path)
        self.drafter.accepted(len(ctx) + kept)
        return Verdict(verdict, answer.resends, fed, sent, time.perf_counter())
