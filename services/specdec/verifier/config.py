"""The verifier's configuration: a replica's settings (it has none of its own yet)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from specdec.replica.config import ReplicaConfig


@dataclass(frozen=True)
class VerifierConfig(ReplicaConfig):
    ROLE: ClassVar[str] = "verifier"
