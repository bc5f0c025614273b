"""Which drafter version a session goes to (`--drafter-canary VERSION:PERCENT`).

A drafter pool may serve two model versions side by side (ModelInfo.model_version, read
from the model directory's specdec_version.json). With a canary, a new session goes to a
drafter of VERSION when the hash of its id falls in the first PERCENT of the hash space,
else to a drafter of any other version: a pure function of the session id, so every turn
of a session, on any gateway replica, makes the same choice. A session that already has a
drafter keeps it (the replica that holds its cache wins); only when that one is gone does
the rule pick again. When no drafter of the wanted side is up, the session takes any
drafter (counted in specdec_gateway_drafter_canary_fallbacks): a drafter changes speed
only, never tokens.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from specdec.common.version import check_version
from specdec.v1 import common_pb2

HASH_SPACE = 2**64


@dataclass(frozen=True)
class Canary:
    version: str
    percent: float  # 0..100: the share of new sessions sent to `version`


def parse_canary(text: str) -> Canary | None:
    """'VERSION:PERCENT' -> Canary; '' -> None; ValueError naming the problem."""
    text = text.strip()
    if not text:
        return None
    version, sep, percent = text.rpartition(":")
    if not sep:
        raise ValueError("expected VERSION:PERCENT, e.g. distill-3f2a1b:10")
    value = float(percent)
    if not 0.0 <= value <= 100.0:
        raise ValueError(f"PERCENT must be in [0, 100], got {percent}")
    return Canary(check_version(version), value)


def session_share(session_key: str) -> float:
    """Where a session id falls in [0, 100): blake2b of the id, uniform over sessions."""
    digest = hashlib.blake2b(session_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") * 100.0 / HASH_SPACE


@dataclass(frozen=True)
class VersionRule:
    """The drafters a session may be placed on: of `version` (canary) or of any other."""

    version: str
    canary: bool

    def matches(self, info: common_pb2.ModelInfo | None) -> bool:
        return info is not None and (info.model_version == self.version) == self.canary


def version_rule(canary: Canary | None, session_key: str) -> VersionRule | None:
    """The rule for a session (None: no canary, any drafter)."""
    if canary is None:
        return None
    return VersionRule(canary.version, session_share(session_key) < canary.percent)
