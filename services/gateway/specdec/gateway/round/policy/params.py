"""The adaptive policy's constants (`PolicyParams`) and what it priced its last decision at
(`Estimate`, which each round's outcome carries)."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.common.cost import BUCKETS


@dataclass(frozen=True)
class PolicyParams:
    """The adaptive policy's constants (specdec.gateway.round.policy.adaptive's docstring)."""

    prior_acceptance: float = 0.7  # of the draft model, before the gateway has seen any
    prior_lookup_acceptance: float = 0.5  # of lookup drafts and extensions, likewise
    prior_weight: float = 4.0  # pseudo-positions of the prior of a gateway that saw nothing
    max_prior_weight: float = 16.0  # the most pseudo-positions the gateway's history is worth
    position_weight: float = 8.0  # pseudo-positions pooling a position towards its source
    exploration: float = 0.5  # c of the upper confidence bound on each acceptance
    idle_token_cost: float = 0.05  # g of an idle verifier (no cost curve reported)
    saturation_queue: float = 4.0  # reported queue depth at which g reaches 1
    smoothing: float = 0.3  # weight of the newest measurement in the moving averages
    prior_hit_rate: float = 0.8  # SSD hit rate before any verdict
    fit_margin: float = 0.9  # a Speculate may take this share of the Verify it hides behind
    branch_cost: float = 0.15  # extra time of each further branch in a batched step
    late_limit: int = 3  # late Speculates in a row at fan-out 1 before SSD pauses
    pause_rounds: int = 16  # rounds without Speculate before SSD is tried again
    # where the gateway's Speculates saved nothing, one new request in this many tries SSD
    # (the others start paused)
    ssd_explore_every: int = 4


@dataclass(frozen=True, slots=True)
class Estimate:
    """What the adaptive policy priced its last decision at: the verifier's rows per
    forward (R), its saturation (u) and the chosen draft's expected tokens per second
    over k = 0's (1.0: speculation not paying, or none chosen)."""

    rows: float
    saturation: float
    gain: float

    @property
    def level(self) -> str:
        """The load level as a metric label: the cost bucket of R rows ("1", "2", "4",
        "8", "16": its lowest rows)."""
        level = BUCKETS[0]
        for edge in BUCKETS:
            if self.rows >= edge - 1e-9:
                level = edge
        return str(level)
