"""Where a request's KV cache lives on one side, and how much of its sequence it holds.

A request keeps one `Placement` per role: the replica that holds its cache and `cached`,
the number of the request's tokens that cache holds. Every call names that prefix (its
length and hash) and sends only what follows, so `cached` must never exceed what the
replica really holds of the request's sequence. It changes only through these named
transitions, each written once here:

- `answered(length)`: the replica answered a call holding `length` tokens;
- `accepted(length)`: the request's sequence is `length` tokens (a verdict rejected the
  draft after them): what the cache holds beyond is stale, so `cached` drops to it;
- `missed()`: the replica does not hold the named prefix (evicted, restarted): nothing;
- `moved(replica)`: the request goes to another replica (a failover, a busy redirect, a
  session whose replica is gone, or None: no replica yet, or none left), which holds
  nothing of it.

A speculative call that must not move the round's placement (SSD's Speculate) works on
a `copy()`.
"""

from __future__ import annotations

from specdec.gateway.fleet.canary import VersionRule
from specdec.gateway.fleet.replicas import Replica


class Placement:
    """Which replica holds a request's KV cache on one side, and how many tokens it holds."""

    __slots__ = ("_cached", "replica", "rule")

    def __init__(
        self,
        replica: Replica | None = None,
        cached: int = 0,
        rule: VersionRule | None = None,
    ):
        self.replica = replica
        self._cached = cached
        # Which drafters a new placement may pick (--drafter-canary); None: any.
        self.rule = rule

    def __repr__(self) -> str:
        return f"Placement({self.address!r}, cached={self._cached})"

    @property
    def cached(self) -> int:
        """Tokens of the request's sequence the replica's cache holds (0: none)."""
        return self._cached

    @property
    def address(self) -> str | None:
        return self.replica.address if self.replica else None

    def answered(self, length: int) -> None:
        """The replica answered a call, holding `length` tokens of the request's."""
        self._cached = length

    def accepted(self, length: int) -> None:
        """The request's sequence is `length` tokens: what the cache holds past them is
        stale (a rejected draft's tail)."""
        self._cached = min(self._cached, length)

    def missed(self) -> None:
        """The replica does not hold the named prefix: the next call sends everything."""
        self._cached = 0

    def moved(self, replica: Replica | None) -> bool:
        """The request goes to `replica` (None: none yet), which holds nothing of it;
        True when a cache was left behind (the whole context is resent)."""
        lost = self._cached > 0 and replica is not self.replica
        self.replica, self._cached = replica, 0
        return lost

    def copy(self) -> Placement:
        """An independent placement on the same replica and cache."""
        return Placement(self.replica, self._cached, self.rule)
