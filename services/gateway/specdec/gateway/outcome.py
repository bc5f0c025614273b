"""What a speculation round did (`Outcome`), and the request's statistics built from it.

A round (specdec.gateway.round.loop) keeps no books: it returns one frozen `Outcome`, and
everything that counts, learns or reports reads that record and nothing else:
`RequestStats.observe` (the request's SpeculationStats and the gateway's metrics), the
k policy's `observe` (specdec.gateway.round.policy) and the round's span
(specdec.gateway.observe.tracing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdec.gateway.names import LOOKUP_SOURCES, DraftMethod, Source, Ssd

# Where a round's draft came from (specdec.gateway.names.Source), by its old names.
DRAFTED = Source.DRAFTED
PREPARED = Source.PREPARED
NO_DRAFT = Source.NO_DRAFT
NO_DRAFTER = Source.NO_DRAFTER
LOOKUP_NGRAM = Source.NGRAM
LOOKUP_SUFFIX = Source.SUFFIX
LOOKUP_PREDICTION = Source.PREDICTION
NO_MATCH = Source.NO_MATCH


def source_label(source: Source) -> str | None:
    """The `method` label of a draft source: "model" for the drafter's drafts (SSD's
    prepared ones included), the lookup source itself, None without a draft."""
    if source in (DRAFTED, PREPARED):
        return DraftMethod.MODEL
    return source if source in LOOKUP_SOURCES else None


# What SSD did in a round (specdec.gateway.names.Ssd), by its old names.
SSD_OFF = Ssd.OFF
SSD_PAUSED = Ssd.PAUSED
SSD_HIT = Ssd.HIT
SSD_MISS = Ssd.MISS
SSD_LATE = Ssd.LATE


@dataclass(frozen=True, slots=True)
class Outcome:
    """One speculation round: what it drafted, what the verifier said, what SSD did, and
    what each step cost (seconds of the gateway's wall clock)."""

    index: int  # the round's index in its request
    max_k: int  # the bound of the round's draft length (the request's k, less near the end)
    k: int  # draft tokens verified (0: the round was a plain target step)
    draft: tuple[int, ...]  # the draft, [k] (a tree's: its accepted path first)
    accepted: int  # draft tokens the verifier accepted, 0..k
    next_token: int  # the recovered (accepted < k) or bonus (accepted == k) token
    source: Source  # where the draft came from
    draft_seconds: float  # the gateway waited this long for its Draft (0 without a call)
    verify_seconds: float  # Verify's round trip
    queue_depth: int  # model requests the verifier had queued when Verify arrived
    resends: int  # full-context resends of the round's Draft and Verify (miss, busy, failover)
    ssd: Ssd = Ssd.OFF  # OFF, PAUSED, HIT, MISS or LATE
    # The last `extended` tokens of a draft model's draft are the lookup's continuation of
    # it (hybrid); their label is LOOKUP_NGRAM.
    extended: int = 0
    # The previous round's late Speculate, decided by this round's Draft: SSD_HIT when the
    # drafter answered it from the branch that Speculate stored, SSD_MISS otherwise.
    late_outcome: Ssd | None = None
    fan_out: int | None = None  # branches asked of the round's Speculate (0: the drafter's
    # default), None when none was sent
    branch_k: int = 0  # their draft length
    branches: int = 0  # branches of a Speculate answered in time
    speculate_seconds: float | None = None  # its round trip, when answered in time
    speculate_bytes: int = 0  # bytes of its request and response
    feature_bytes: int = 0  # the target's features its verdict returned (a head drafter's)
    hidden_seconds: float = 0.0  # Speculate time that overlapped the Verify
    seconds: float = 0.0  # the whole round
    verify_forward_ms: float = 0.0  # the Verify's time on the verifier, as it reported it
    verify_fed: int = 0  # tokens the Verify fed (new tokens + the draft)
    draft_forward_ms: float = 0.0  # the Draft's forwards, as the drafter reported them
    draft_fed: int = 0  # tokens the Draft call fed before drafting (0: not known)
    # The Verify's scores when the request asked (common_pb2.TokenLogprobs): of `tokens`,
    # and (first round only) of the prompt.
    logprobs: Any = None
    prompt_logprobs: Any = None
    width: int = 1  # a token tree's branches at the root (1: a chain)
    branch: int | None = None  # the root branch the accepted path took (None: none)
    chain: int = 0  # a tree's first branch (the draft a chain would be): its tokens; 0: a chain
    on_chain: int = 0  # a tree's accepted nodes on its first branch
    tree_leaves: int = 0  # the drafter's tree: its leaves (alternatives to draft tokens)
    tree_depth: int = 0  # the drafter's tree: the forwards that continued its leaves
    # What the adaptive policy priced the round's draft at (specdec.gateway.round.policy.Estimate):
    # the verifier's load level (the cost bucket of its rows per forward: "1", "2", "4",
    # "8", "16"), its saturation u and the draft's expected tokens per second over k = 0's;
    # "" / None when no estimate was made (a fixed policy, nothing measured yet).
    load_level: str = ""
    saturation: float = 0.0
    gain: float | None = None

    @property
    def tree(self) -> bool:
        return self.chain > 0

    @property
    def chain_verdict(self) -> tuple[int, int]:
        """(k, accepted) of the draft a chain would have verified: a tree's first branch
        and its accepted nodes, a chain's own."""
        if not self.tree:
            return self.k, self.accepted
        return self.chain, self.on_chain

    @property
    def tokens(self) -> tuple[int, ...]:
        """What the round appends: the accepted drafts, then the next token."""
        return (*self.draft[: self.accepted], self.next_token)


@dataclass
class RequestStats:
    """A request's speculation statistics, summed over its rounds' outcomes."""

    adaptive: bool = False  # the request's k policy (k = 0 by choice is counted then)
    rounds: int = 0
    drafts: int = 0  # rounds that had a draft (k > 0)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    rounds_by_k: list[int] = field(default_factory=list)  # [k]: rounds that drafted k
    cache_misses: int = 0  # full-context resends
    ssd_hits: int = 0
    ssd_misses: int = 0
    ssd_branches: int = 0
    ssd_speculates: int = 0  # Speculates sent
    ssd_late: int = 0  # of them, still running at their verdict (cancelled)
    ssd_hidden_ms: float = 0.0  # Speculate time that overlapped a verification
    ssd_bytes: int = 0  # Speculate requests + responses
    drafter_wait_ms: float = 0.0  # gateway blocked on the drafter
    policy_k0_rounds: int = 0  # rounds the adaptive policy chose k = 0
    fan_out_sum: int = 0  # fan-outs asked for, over the Speculates sent
    ssd_paused_rounds: int = 0  # rounds with a draft whose Speculate the policy held back
    queue_sum: int = 0  # verifier queue depths reported, over the rounds
    # source label -> [drafts, draft tokens, accepted tokens] (see source_label)
    by_source: dict[str, list[int]] = field(default_factory=dict)
    no_match_rounds: int = 0  # lookup rounds that found nothing to draft
    tree_rounds: int = 0  # rounds that verified a token tree
    tree_nodes: int = 0  # their nodes
    tree_other_branch_rounds: int = 0  # of them, whose path took another branch than the first
    feature_bytes: int = 0  # the target's features the verdicts returned (a head drafter's)

    def observe(self, o: Outcome) -> None:
        self.rounds += 1
        k = o.k
        if len(self.rounds_by_k) <= k:
            self.rounds_by_k.extend([0] * (k + 1 - len(self.rounds_by_k)))
        self.rounds_by_k[k] += 1
        self.drafts += k > 0
        self.draft_tokens += k
        self.accepted_tokens += o.accepted
        if len(self.accepted_per_position) < k:
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        for i in range(o.accepted):
            self.accepted_per_position[i] += 1
        self.cache_misses += o.resends
        self.drafter_wait_ms += o.draft_seconds * 1e3
        self.queue_sum += o.queue_depth
        self.policy_k0_rounds += self.adaptive and o.source == NO_DRAFT and o.max_k > 0
        self.ssd_hits += (o.ssd == SSD_HIT) + (o.late_outcome == SSD_HIT)
        self.ssd_misses += (o.ssd == SSD_MISS) + (o.late_outcome == SSD_MISS)
        self.ssd_late += o.ssd == SSD_LATE
        self.ssd_paused_rounds += o.ssd == SSD_PAUSED
        self.ssd_speculates += o.fan_out is not None
        self.fan_out_sum += o.fan_out or 0
        self.ssd_branches += o.branches
        self.ssd_bytes += o.speculate_bytes
        self.feature_bytes += o.feature_bytes
        self.ssd_hidden_ms += o.hidden_seconds * 1e3
        self.no_match_rounds += o.source == NO_MATCH
        if o.tree:
            self.tree_rounds += 1
            self.tree_nodes += o.k
            self.tree_other_branch_rounds += bool(o.branch)
        label = source_label(o.source) if k else None
        if label is not None:
            own = k - o.extended
            self._count(label, own, min(o.accepted, own))
            if o.extended:
                self._count(LOOKUP_NGRAM, o.extended, max(0, o.accepted - own))

    def _count(self, label: str, tokens: int, accepted: int) -> None:
        row = self.by_source.setdefault(label, [0, 0, 0])
        row[0] += 1
        row[1] += tokens
        row[2] += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return (self.accepted_tokens + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def mean_k(self) -> float:
        return self.draft_tokens / self.rounds if self.rounds else 0.0

    @property
    def mean_fan_out(self) -> float:
        return self.fan_out_sum / self.ssd_speculates if self.ssd_speculates else 0.0

    @property
    def mean_verifier_queue(self) -> float:
        return self.queue_sum / self.rounds if self.rounds else 0.0
