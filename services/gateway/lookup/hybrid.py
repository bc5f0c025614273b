"""A request's lookup proposer: the method's choice of draft per round.

- `model`: never a lookup draft (a prediction aside);
- `ngram`: prompt lookup (specdec.gateway.lookup.ngram);
- `suffix`: suffix decoding over the request's text and the gateway's cache of recent
  outputs, the better-scored of the two (specdec.gateway.lookup.suffix);
- `hybrid`: the suffix draft when its match is confident (at least `confident_match`
  tokens matched and `confident_score` tokens expected accepted), else the draft model.

A prediction (OpenAI's Predicted Outputs) is tried first under every method: the caller
said what to expect. The indexes follow the context as it grows (only the tokens added
since the last round are indexed), so a round costs microseconds whatever its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specdec.gateway.lookup import HYBRID, MODEL, NGRAM, PREDICTION, SUFFIX
from specdec.gateway.lookup.ngram import NgramIndex
from specdec.gateway.lookup.prediction import PredictionMatcher
from specdec.gateway.lookup.suffix import Grower, SuffixCache, SuffixParams, draft


@dataclass(frozen=True)
class LookupSettings:
    """The gateway's lookup settings (flags --prompt-lookup-min/max, --suffix-*)."""

    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 5
    suffix: SuffixParams = field(default_factory=SuffixParams)
    confident_match: int = 4  # hybrid: suffix tokens matched before a lookup draft is used
    confident_score: float = 2.0  # hybrid: and tokens it is expected to get accepted


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]  # [k], k >= 1
    source: str  # NGRAM, SUFFIX or PREDICTION


class RequestLookup:
    """Lookup drafts for one turn. ctx is the turn's whole context (history, prompt and
    the output so far); `output_from` is where the output starts in it."""

    def __init__(
        self,
        method: str,
        settings: LookupSettings,
        *,
        output_from: int,
        prediction: Sequence[int] = (),
        cache: SuffixCache | None = None,
        cache_key: str = "",
        draft_from_cache: bool = True,
    ):
        self.method = method
        self.settings = settings
        self.output_from = output_from
        self.prediction = PredictionMatcher(prediction) if prediction else None
        self.cache = cache  # drafts under suffix / hybrid; every method's output fills it
        # False for a seeded sampled request: its drafts, hence its seeded draws, must not
        # depend on other requests' outputs (it stays reproducible).
        self.draft_from_cache = draft_from_cache
        self.cache_key = cache_key
        self.ngram = (
            NgramIndex(settings.prompt_lookup_min, settings.prompt_lookup_max)
            if method == NGRAM
            else None
        )
        self.grower = Grower(settings.suffix.depth) if method in (SUFFIX, HYBRID) else None

    @property
    def active(self) -> bool:
        """Whether this request ever proposes a lookup draft."""
        return self.method != MODEL or self.prediction is not None

    def follow(self, ctx: Sequence[int]) -> None:
        """Index what ctx added since the last call (the whole prompt the first time: the
        turn runs that one in a worker thread, off the event loop)."""
        for index in (self.ngram, self.grower):
            if index is not None and len(index.tokens) < len(ctx):
                index.extend(ctx[len(index.tokens) :])

    def propose(self, ctx: Sequence[int], k: int) -> Proposal | None:
        """At most k lookup tokens to draft after ctx, or None (the method's fallback:
        the draft model under model / hybrid, no draft under ngram / suffix)."""
        if k <= 0 or not self.active:
            return None
        if self.prediction is not None:
            tokens = self.prediction.propose(ctx[self.output_from :], k)
            if tokens:
                return Proposal(tokens, PREDICTION)
        self.follow(ctx)
        if self.ngram is not None:
            tokens, _ = self.ngram.propose(k)
            return Proposal(tokens, NGRAM) if tokens else None
        if self.grower is None:
            return None
        best = draft(self.grower.trie, ctx, k, self.settings.suffix)
        if self.cache is not None and self.draft_from_cache:  # (the method: suffix, hybrid)
            cached = self.cache.draft(self.cache_key, ctx, k)
            if cached.score > best.score:
                best = cached
        if not best.tokens:
            return None
        if self.method == HYBRID and (
            best.match_length < self.settings.confident_match
            or best.score < self.settings.confident_score
        ):
            return None
        return Proposal(best.tokens[:k], SUFFIX)

    def finish(self, output: Sequence[int]) -> None:
        """The turn's output, for the gateway's cache of recent outputs."""
        if self.cache is not None and output:
            self.cache.add(self.cache_key, output)
