"""The gateway's named values: replica roles, draft sources and SSD outcomes; and, from
the SDK (specdec.sdk.names, where each is declared once with its proto enum), speculation
methods, k policies and why a completion finished.

Each is a str-Enum whose values are the strings the gateway has always written: metric
label values, JSON (the recorder's rows, SpeculationStats.by_source), log fields and span
attributes read them unchanged, and a member compares equal to its string.
"""

from __future__ import annotations

from specdec.sdk.names import DraftMethod, Finish, KPolicy, StrEnum

__all__ = [
    "LOOKUP_SOURCES",
    "DraftMethod",
    "Finish",
    "KPolicy",
    "Role",
    "Source",
    "Ssd",
    "StrEnum",
]


class Role(StrEnum):
    """What a replica does for the gateway (the `role` label)."""

    DRAFTER = "drafter"
    VERIFIER = "verifier"


class Source(StrEnum):
    """Where a round's draft came from (Outcome.source)."""

    DRAFTED = "drafter"  # a Draft call that ran the drafter's model
    PREPARED = "prepared"  # an SSD branch: held by the gateway (greedy) or by the drafter
    NO_DRAFT = "none"  # k = 0 by choice (the request's k, the policy, or no room left)
    NO_DRAFTER = "no-drafter"  # k = 0 because no drafter could draft (same output, slower)
    # Lookup drafts built by the gateway (specdec.gateway.round.lookup): no model call, one-hot q.
    NGRAM = "ngram"
    SUFFIX = "suffix"
    PREDICTION = "prediction"
    NO_MATCH = "no-match"  # k = 0 because the request's lookup method found nothing

    @property
    def lookup(self) -> bool:
        """A lookup draft (no model call)."""
        return self in LOOKUP_SOURCES


LOOKUP_SOURCES = (Source.NGRAM, Source.SUFFIX, Source.PREDICTION)


class Ssd(StrEnum):
    """What SSD did in a round (Outcome.ssd, Outcome.late_outcome)."""

    OFF = "off"  # no Speculate (SSD off, no draft, or no room for another round)
    PAUSED = "paused"  # the adaptive policy held it back (late even at fan-out 1)
    SENT = "sent"  # a Speculate left beside the Verify (its state until the verdict)
    HIT = "hit"  # the verified outcome had a prepared draft
    MISS = "miss"  # it had none (or the Speculate failed)
    LATE = "late"  # still running at the verdict: cancelled; the next Draft decides
