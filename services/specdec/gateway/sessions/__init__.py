"""The session index: per-session token history and cache affinity, kept in Redis (design §3).

- ``record``: what a session is (SessionRecord) and its Redis hash format;
- ``local``: the bounded in-process copy used while Redis is unreachable;
- ``index``: SessionIndex, Redis with that local fallback and the write-back after an outage;
- ``turns``: TurnLocks, one turn at a time per session across gateway replicas;
- ``ids``: the id under which the replicas cache a request's KV (replica_session_id).
"""

from specdec.gateway.sessions.ids import replica_session_id
from specdec.gateway.sessions.index import LockLost, SessionIndex
from specdec.gateway.sessions.record import MAX_SESSION_ID_LEN, SessionRecord, validate_session_id
from specdec.gateway.sessions.turns import TurnLease, TurnLocks

__all__ = [
    "MAX_SESSION_ID_LEN",
    "LockLost",
    "SessionIndex",
    "SessionRecord",
    "TurnLease",
    "TurnLocks",
    "replica_session_id",
    "validate_session_id",
]
