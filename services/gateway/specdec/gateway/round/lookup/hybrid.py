"""A request's lookup proposer: the method's choice of draft per round.

- `model`: never a lookup draft (a prediction aside);
- `ngram`: prompt lookup (specdec.gateway.round.lookup.ngram);
- `suffix`: suffix decoding over the request's text and the gateway's cache of recent
  outputs, the better-scored of the two (specdec.gateway.round.lookup.suffix);
- `hybrid`: a prompt-lookup draft when the request's own text has a confident match (an
  n-gram of at least `confident_match` tokens), else the cache of recent outputs when its
  suffix match is confident (that many tokens matched and `confident_score` tokens
  expected accepted), else the draft model, whose draft the lookup then extends
  (`extend`): the n-gram ending the model's draft proposes what followed it.

Why this order. A lookup draft costs no drafting and its verification costs little more
than a plain step (a 1.5B target verifies 17 tokens in 1.08x the time of 1 on one CPU core),
so a long lookup draft pays whenever it is accepted. Replaying the target's own greedy
outputs on the shipped grounded prompts (128 tokens, drafter steps at 0.35 of a target
step, no SSD) gives, in tokens per unit of target time: the draft model at k = 3 1.87,
suffix decoding alone 2.61, prompt lookup alone 3.26, the previous hybrid (a confident
suffix match, else the drafter) 2.99, and this one 3.99. Suffix decoding's draft length
(the match length x spec_factor, cut at probability 0.1) is what holds it back there.

A prediction (OpenAI's Predicted Outputs) is tried first under every method: the caller
said what to expect. The indexes follow the context as it grows (only the tokens added
since the last round are indexed), so a round costs microseconds whatever its length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specdec.gateway.names import Source
from specdec.gateway.round.lookup import HYBRID, MODEL, NGRAM, PREDICTION, SUFFIX
from specdec.gateway.round.lookup.ngram import NgramIndex
from specdec.gateway.round.lookup.prediction import PredictionMatcher
from specdec.gateway.round.lookup.settings import LookupSettings
from specdec.gateway.round.lookup.suffix import Grower, SuffixCache, SuffixDraft, branches


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]  # [k], k >= 1
    source: Source  # NGRAM, SUFFIX or PREDICTION
    # With width > 1: other candidate continuations, each starting with another token
    # than tokens and the ones before it (specdec.gateway.round.tree merges them).
    others: tuple[list[int], ...] = ()


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
        width: int = 1,
    ):
        self.method = method
        self.width = width  # candidate continuations per round (1: a chain)
        self.settings = settings
        self.output_from = output_from
        self.prediction = PredictionMatcher(prediction) if prediction else None
        self.cache = cache  # drafts under suffix / hybrid; every method's output fills it
        # False for a seeded sampled request: its drafts, hence its seeded draws, must not
        # depend on other requests' outputs (it stays reproducible).
        self.draft_from_cache = draft_from_cache
        self.cache_key = cache_key
        self.ngram = (
            NgramIndex(settings.prompt_lookup_min, settings.prompt_lookup_max, width)
            if method in (NGRAM, HYBRID)
            else None
        )
        self.grower = Grower(settings.suffix.depth) if method == SUFFIX else None

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
        if self.method == NGRAM:
            tokens, _ = self._ngram.propose(k)
            return Proposal(tokens, Source.NGRAM, self._ngram_others(k)) if tokens else None
        if self.method == HYBRID:
            return self._hybrid(ctx, k)
        if self.grower is None:
            return None
        found = branches(self.grower.trie, ctx, k, self.settings.suffix, self.width)
        found += self._cached(ctx, k)
        found = [d for d in found if d.tokens]
        if not found:
            return None
        found.sort(key=lambda d: -d.score)  # the best-scored first: the chain's draft
        return _suffix_proposal(found, k, self.width)

    @property
    def _ngram(self) -> NgramIndex:
        """The n-gram index, which the methods ngram and hybrid have."""
        assert self.ngram is not None, f"no n-gram index under {self.method}"
        return self.ngram

    def _ngram_others(self, k: int) -> tuple[list[int], ...]:
        """The n-gram index's other candidates (none at width 1)."""
        if self.width <= 1:
            return ()
        return tuple(self._ngram.candidates(k, self.width)[1:])

    def _hybrid(self, ctx: Sequence[int], k: int) -> Proposal | None:
        confident = self.settings.confident_match
        tokens, n = self._ngram.propose(k)
        if tokens and n >= confident:
            return Proposal(tokens, Source.NGRAM, self._ngram_others(k))
        cached = self._cached(ctx, k)
        best = cached[0] if cached else None
        if (
            best is not None
            and best.tokens
            and best.match_length >= confident
            and best.score >= self.settings.confident_score
        ):
            return _suffix_proposal(cached, k, self.width)
        return None

    def _cached(self, ctx: Sequence[int], k: int) -> list[SuffixDraft]:
        """The cache of recent outputs' drafts, up to `width`, its own best first (none:
        no cache, or not for this request)."""
        if self.cache is None or not self.draft_from_cache:
            return []
        return self.cache.branches(self.cache_key, ctx, k, self.width)

    def extend(self, ctx: Sequence[int], model_draft: Sequence[int], k: int) -> list[int]:
        """Under hybrid, up to k lookup tokens to verify after the draft model's draft
        (ctx + model_draft): what followed the longest n-gram ending it in the request's
        text. Empty under the other methods, and where nothing matches."""
        if self.method != HYBRID or k <= 0 or not model_draft:
            return []
        self.follow(ctx)
        return self._ngram.propose(k, model_draft)[0]

    def finish(self, output: Sequence[int]) -> None:
        """The turn's output, for the gateway's cache of recent outputs."""
        if self.cache is not None and output:
            self.cache.add(self.cache_key, output)


def _suffix_proposal(found: list[SuffixDraft], k: int, width: int) -> Proposal:
    """Suffix drafts, best first, as a proposal: the first its tokens, up to width - 1
    others (each starting with another token) its other candidates."""
    firsts = {found[0].tokens[0]}
    others: list[list[int]] = []
    for d in found[1:]:
        if d.tokens[0] not in firsts and len(others) < width - 1:
            firsts.add(d.tokens[0])
            others.append(d.tokens[:k])
    return Proposal(found[0].tokens[:k], Source.SUFFIX, tuple(others))
