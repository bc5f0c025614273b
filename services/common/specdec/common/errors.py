"""The serving stack's errors: subclasses of the SDK's one tree (specdec.sdk.errors).

Each class's `code` is its gRPC status (specdec.common.serving answers with it) and its
`reason` the typed Reason (sent in the trailing metadata REASON_KEY and in data-plane
error frames), so a caller acts on the type, never on the message's wording. The HTTP API
maps (code, reason) to its answers in one table (specdec.gateway.front.http.errors).
"""

from __future__ import annotations

import grpc

from specdec.sdk.errors import (
    REASON_KEY,
    RETRY_AFTER_KEY,
    DeadlineExceeded,
    InvalidRequest,
    Reason,
    ResourceExhausted,
    SpecdecError,
    Unavailable,
    Unimplemented,
)

__all__ = [
    "BUSY_PREFIX",
    "CACHE_MISS_PREFIX",
    "REASON_KEY",
    "RETRY_AFTER_KEY",
    "CacheMiss",
    "CapacityExceeded",
    "DeadlineExceeded",
    "FailedPrecondition",
    "InvalidRequest",
    "NotReady",
    "Reason",
    "ReplicaBusy",
    "SpecdecError",
    "Unavailable",
    "Unimplemented",
]


class CacheMiss(SpecdecError):
    """The replica does not hold the prefix the request builds on; resend the full context."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.CACHE_MISS


class FailedPrecondition(SpecdecError):
    """The replica cannot serve this request as it was started (the target's features
    from a llama.cpp verifier; a token tree or SSD from a head drafter): the message says
    which, and what would."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class CapacityExceeded(ResourceExhausted):
    """The request cannot fit the replica's bounded KV cache even after evicting others."""

    reason = Reason.CAPACITY


class ReplicaBusy(ResourceExhausted):
    """Backpressure: --max-queue requests already wait for this replica's model; try
    another replica or later (CapacityExceeded shares the status code and means the KV
    cache bound, which no retry fixes: the reason tells them apart)."""

    reason = Reason.BUSY


class NotReady(Unavailable):
    """The model is still loading (a replica), or the replicas have not all answered yet
    (the gateway)."""

    reason = Reason.LOADING


# The first words of every cache-miss and ReplicaBusy message, for people reading logs;
# programs tell them apart by their reason (REASON_KEY), never by the wording.
CACHE_MISS_PREFIX = "cache miss"
BUSY_PREFIX = "replica busy"
