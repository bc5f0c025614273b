"""The ids under which the replicas cache a request's KV."""

from __future__ import annotations

import hashlib
import uuid


def replica_session_id(session_id: str | None) -> str:
    """The id under which the replicas cache a request's KV (34 characters).

    A user session is `s/<blake2b-128 of its id>`, so its turns reuse one cache; the user's
    id itself (up to MAX_SESSION_ID_CHARS of anything, which may identify a person) never
    reaches a replica, its logs or its spans, and no id is too long for the replicas'
    bound. A one-off request gets `r/<random>`, released when it ends. The prefixes keep
    the two apart: no session id a user picks can name a one-off request's cache.
    """
    if not session_id:
        return f"r/{uuid.uuid4().hex}"
    return "s/" + hashlib.blake2b(session_id.encode(), digest_size=16).hexdigest()
