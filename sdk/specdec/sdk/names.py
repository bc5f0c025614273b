"""The named values a request and its response carry, each declared once with its proto
enum: where drafts come from (:class:`DraftMethod`), how each round's draft length is
chosen (:class:`KPolicy`) and why a completion ended (:class:`Finish`).

Each is a str-Enum: a member is the string the API has always spoken (``"ngram"``,
``"adaptive"``, ``"eos"``: metric labels, JSON, keyword arguments) and compares equal to
it. ``member.proto`` is its value in ``specdec.v1`` (the proto's name is its prefix and the
member's name: ``SPECULATION_METHOD_NGRAM``), and ``Enum.of(value)`` reads one back.
"""

from __future__ import annotations

import enum
import sys
from typing import TypeVar, cast

from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

from specdec.v1 import gateway_pb2

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # pragma: no cover - Python 3.10

    class StrEnum(str, enum.Enum):
        """enum.StrEnum of Python 3.11: str() and format() give the value."""

        __str__ = str.__str__
        __format__ = str.__format__


__all__ = ["DraftMethod", "Finish", "KPolicy", "StrEnum", "WireEnum"]

W = TypeVar("W", bound="WireEnum")


class WireEnum(StrEnum):
    """A str-Enum whose members are values of a proto enum: member ``NAME`` is the proto's
    ``<prefix>NAME`` (the subclass's ``wire()`` says which enum and which prefix)."""

    @classmethod
    def wire(cls) -> tuple[EnumTypeWrapper, str]:
        """The proto enum and the prefix of its value names."""
        raise NotImplementedError

    @property
    def proto(self) -> int:
        """The member's value in its proto enum."""
        enum_type, prefix = self.wire()
        return int(enum_type.Value(prefix + self.name))

    @classmethod
    def of(cls: type[W], value: int) -> W:
        """The member of a proto value (KeyError: UNSPECIFIED or a value this version does
        not know)."""
        for member in cls:
            if member.proto == value:
                return member
        raise KeyError(value)


class DraftMethod(WireEnum):
    """Where a request's drafts come from (``SpeculationParams.method``)."""

    MODEL = "model"  # the drafter's model
    NGRAM = "ngram"  # prompt lookup
    SUFFIX = "suffix"  # suffix decoding
    HYBRID = "hybrid"  # a lookup where its match is confident, else the model, extended

    @classmethod
    def wire(cls) -> tuple[EnumTypeWrapper, str]:
        return gateway_pb2.SpeculationMethod, "SPECULATION_METHOD_"

    @property
    def proto(self) -> gateway_pb2.SpeculationMethod:
        """The gateway_pb2.SpeculationMethod value."""
        return cast(gateway_pb2.SpeculationMethod, super().proto)


class KPolicy(WireEnum):
    """How each round's draft length is chosen (``SpeculationParams.k_policy``)."""

    FIXED = "fixed"
    ADAPTIVE = "adaptive"

    @classmethod
    def wire(cls) -> tuple[EnumTypeWrapper, str]:
        return gateway_pb2.KPolicy, "K_POLICY_"

    @property
    def proto(self) -> gateway_pb2.KPolicy:
        """The gateway_pb2.KPolicy value."""
        return cast(gateway_pb2.KPolicy, super().proto)


class Finish(WireEnum):
    """Why a completion ended (``GenerateResponse.finish_reason``)."""

    LENGTH = "length"  # max_new_tokens
    EOS = "eos"  # the model's EOS (unless ignore_eos)
    STOP = "stop"  # a stop string or one of stop_token_ids

    @classmethod
    def wire(cls) -> tuple[EnumTypeWrapper, str]:
        return gateway_pb2.FinishReason, "FINISH_REASON_"

    @property
    def proto(self) -> gateway_pb2.FinishReason:
        """The gateway_pb2.FinishReason value."""
        return cast(gateway_pb2.FinishReason, super().proto)
