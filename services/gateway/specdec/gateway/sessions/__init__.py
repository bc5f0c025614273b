"""The session index: per-session token history and cache affinity, kept in Redis (design §3).

- ``record``: what a session is (SessionRecord) and its Redis hash format;
- ``local``: the gateway's bounded in-process copy (Redis unreachable, or lost the record);
- ``index``: SessionIndex, Redis with that local copy and the write-back from it;
- ``turns``: TurnLocks, one turn at a time per session across gateway replicas (a lease
  renewed by its live turn, a fencing token ordering the history writes);
- ``ids``: the id under which the replicas cache a request's KV (replica_session_id).

It may import observe and the ground floor; never the round, the fleet, the front, the
service or config.
"""

from specdec.gateway.sessions.ids import replica_session_id
from specdec.gateway.sessions.index import LockLost, SessionIndex
from specdec.gateway.sessions.record import MAX_SESSION_ID_LEN, SessionRecord, validate_session_id
from specdec.gateway.sessions.turns import (
    DEFAULT_LEASE_SECONDS,
    Holder,
    SessionBusy,
    SessionLost,
    TurnLease,
    TurnLocks,
)

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "MAX_SESSION_ID_LEN",
    "Holder",
    "LockLost",
    "SessionBusy",
    "SessionIndex",
    "SessionLost",
    "SessionRecord",
    "TurnLease",
    "TurnLocks",
    "replica_session_id",
    "validate_session_id",
]
