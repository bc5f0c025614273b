"""Domain errors of the serving stack and the one place they map to gRPC status codes."""

from __future__ import annotations

import grpc


class SpecdecError(Exception):
    """Base class: an error the caller can act on, with the gRPC status it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    # Why, beyond the code: a name of the Reason enum (protos/specdec/v1/dataplane.proto),
    # sent in data-plane error frames and in gRPC's trailing metadata REASON_KEY, so a
    # client acts on the type, not on the message's wording.
    reason: str = "REASON_UNSPECIFIED"


class InvalidRequest(SpecdecError, ValueError):
    """Malformed input: bad token ids, empty input, k too large, bad sampling values."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Unimplemented(SpecdecError):
    """A valid request for something this replica does not do yet (the message says what)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class CacheMiss(SpecdecError):
    """The replica does not hold the prefix the request builds on; resend the full context."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "REASON_CACHE_MISS"


class CapacityExceeded(SpecdecError):
    """The request cannot fit the replica's bounded KV cache even after evicting others."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "REASON_CAPACITY"


class ReplicaBusy(SpecdecError):
    """Backpressure: --max-queue requests already wait for this replica's model; try
    another replica or later. The message starts with BUSY_PREFIX (CapacityExceeded shares
    the status code and means the KV cache bound, which no retry fixes)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "REASON_BUSY"


class NotReady(SpecdecError):
    """The model is still loading."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "REASON_LOADING"


# The gRPC trailing metadata key that carries a failed call's reason (SpecdecError.reason).
REASON_KEY = "specdec-reason"

# The first words of every cache-miss and ReplicaBusy message, for people reading logs;
# programs tell them apart by their reason (REASON_KEY), never by the wording.
CACHE_MISS_PREFIX = "cache miss"
BUSY_PREFIX = "replica busy"
