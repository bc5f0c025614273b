"""The gateway's bounded in-process copy of session records.

An LRU of at most ``capacity`` records, each expiring like its Redis key, written on every
put and filled on every successful get. It serves while Redis is unreachable, and restores a
record Redis lost: the index writes a record back to Redis at the next successful read of
that session when Redis lacks it, or when it was written here during an outage (*dirty*)
and Redis holds an older one; dirty records go back as soon as Redis answers again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from specdec.gateway.sessions.record import SessionRecord


@dataclass
class LocalEntry:
    record: SessionRecord
    expires_at: float  # time.monotonic()
    dirty: bool = False  # written while Redis was unreachable; not in Redis yet


class LocalCopy:
    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"local_capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, LocalEntry] = OrderedDict()

    def __len__(self) -> int:
        """Records held (including expired ones not yet dropped)."""
        return len(self._entries)

    def entry(self, session_id: str) -> LocalEntry | None:
        """The session's live entry (an expired one is dropped), marked recently used."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if entry.expires_at <= time.monotonic():
            del self._entries[session_id]
            return None
        self._entries.move_to_end(session_id)
        return entry

    def get(self, session_id: str) -> SessionRecord | None:
        entry = self.entry(session_id)
        return entry.record.copy() if entry is not None else None

    def put(self, record: SessionRecord, expires_in: float, *, dirty: bool) -> None:
        if self.capacity == 0:
            return
        self._entries[record.session_id] = LocalEntry(
            record=record.copy(), expires_at=time.monotonic() + expires_in, dirty=dirty
        )
        self._entries.move_to_end(record.session_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def dirty(self) -> list[str]:
        """The sessions written here while Redis was unreachable and not written back yet."""
        return [sid for sid, entry in self._entries.items() if entry.dirty]

    def pop(self, session_id: str) -> None:
        self._entries.pop(session_id, None)
