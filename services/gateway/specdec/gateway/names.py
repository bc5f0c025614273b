"""The gateway's named values: replica roles, speculation methods, draft sources, SSD
outcomes, k policies and why a completion finished.

Each is a str-Enum whose values are the strings the gateway has always written: metric
label values, JSON (the recorder's rows, SpeculationStats.by_source), log fields and span
attributes read them unchanged, and a member compares equal to its string.
"""

from __future__ import annotations

import enum
import sys

from specdec.v1 import gateway_pb2

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """enum.StrEnum of Python 3.11: str() and format() give the value."""

        __str__ = str.__str__
        __format__ = str.__format__


class Role(StrEnum):
    """What a replica does for the gateway (the `role` label)."""

    DRAFTER = "drafter"
    VERIFIER = "verifier"


class DraftMethod(StrEnum):
    """Where a request's drafts come from (SpeculationParams.method)."""

    MODEL = "model"  # the drafter's model
    NGRAM = "ngram"  # prompt lookup
    SUFFIX = "suffix"  # suffix decoding
    HYBRID = "hybrid"  # a lookup where its match is confident, else the model, extended

    @property
    def proto(self) -> gateway_pb2.SpeculationMethod:
        """The gateway_pb2.SpeculationMethod value."""
        return _METHOD_PROTO[self]

    @classmethod
    def of(cls, value: int) -> DraftMethod:
        """The method of a gateway_pb2.SpeculationMethod value (KeyError: UNSPECIFIED or
        unknown)."""
        return _METHOD_OF[value]


_METHOD_PROTO = {
    DraftMethod.MODEL: gateway_pb2.SPECULATION_METHOD_MODEL,
    DraftMethod.NGRAM: gateway_pb2.SPECULATION_METHOD_NGRAM,
    DraftMethod.SUFFIX: gateway_pb2.SPECULATION_METHOD_SUFFIX,
    DraftMethod.HYBRID: gateway_pb2.SPECULATION_METHOD_HYBRID,
}
_METHOD_OF: dict[int, DraftMethod] = {value: method for method, value in _METHOD_PROTO.items()}


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


class KPolicy(StrEnum):
    """How each round's draft length is chosen (SpeculationParams.k_policy)."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"

    @property
    def proto(self) -> gateway_pb2.KPolicy:
        """The gateway_pb2.KPolicy value."""
        return _POLICY_PROTO[self]

    @classmethod
    def of(cls, value: int) -> KPolicy:
        """The policy of a gateway_pb2.KPolicy value (KeyError: UNSPECIFIED or unknown)."""
        return _POLICY_OF[value]


_POLICY_PROTO = {
    KPolicy.FIXED: gateway_pb2.K_POLICY_FIXED,
    KPolicy.ADAPTIVE: gateway_pb2.K_POLICY_ADAPTIVE,
}
_POLICY_OF: dict[int, KPolicy] = {value: policy for policy, value in _POLICY_PROTO.items()}


class Finish(StrEnum):
    """Why a completion ended (GenerateResponse.finish_reason; the `finish_reason` label)."""

    LENGTH = "length"  # max_new_tokens
    EOS = "eos"  # the model's EOS (unless ignore_eos)
    STOP = "stop"  # a stop string or one of stop_token_ids

    @property
    def proto(self) -> gateway_pb2.FinishReason:
        """The gateway_pb2.FinishReason value."""
        return _FINISH_PROTO[self]


_FINISH_PROTO = {
    Finish.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    Finish.EOS: gateway_pb2.FINISH_REASON_EOS,
    Finish.STOP: gateway_pb2.FINISH_REASON_STOP,
}
