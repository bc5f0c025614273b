"""A head drafter's features through the gateway (docs/concepts/heads.md).

A drafter whose Info names features (ModelInfo.features: `specdec serve drafter --head`)
drafts from the target's hidden states. For a request drafted there, each Verify asks the
verifier for them (VerifyRequest.features) and the verdict returns those of the positions
it made known (VerifyResponse.features); they wait here until the next Draft carries them
(DraftRequest.features), and are dropped once a Draft has been answered with them. A
gateway over head drafters sends them chains, trees and Speculates as to any drafter (a
Speculate carries no features: the head pre-drafts with its own).

A request's first round over a head drafter drafts nothing (`awaits_prompt`): its Verify
is the prompt's prefill, whose verdict returns the prompt's features (at most the
verifier's MAX_FEATURE_BYTES, 32 MiB: the last positions that fit), so the head's first
Draft reads the target's features of the prompt instead of zeros, as EAGLE drafts after
the target's prefill.

Bounded: at most MAX_PENDING_BYTES wait per request (rounds without a Draft add theirs);
past it the oldest go, and the head feeds those positions a zero feature (it counts them).
"""

from __future__ import annotations

from specdec.gateway.fleet.placement import Placement
from specdec.gateway.fleet.replicas import Fleet
from specdec.v1 import common_pb2, verifier_pb2

MAX_PENDING_BYTES = 64 << 20


class FeatureRelay:
    """One request's features on their way from the verifier to a head drafter."""

    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self.pending: list[common_pb2.Features] = []
        self.bytes = 0
        self.verdicts = 0  # the request's verdicts so far

    def awaits_prompt(self, drafter: Placement) -> bool:
        """Whether this round drafts nothing: a head drafter's request before its first
        verdict, which brings the prompt's features for its first Draft."""
        return self.verdicts == 0 and self.ask(drafter) is not None

    def ask(self, drafter: Placement) -> common_pb2.FeatureRequest | None:
        """What the request's drafter drafts from: the features its replica's Info names
        (before its first Draft: an up drafter's of the pool); None for a model drafter."""
        replicas = [drafter.replica] if drafter.replica is not None else self.fleet.drafters.up()
        for replica in replicas:
            if replica.info is not None and replica.info.HasField("features"):
                return replica.info.features
        return None

    def verdict(self, response: verifier_pb2.VerifyResponse) -> None:
        """Keep the features a verdict returned for the next Draft."""
        self.verdicts += 1
        if not response.HasField("features"):
            return
        self.pending.append(response.features)
        self.bytes += len(response.features.data)
        while self.bytes > MAX_PENDING_BYTES and len(self.pending) > 1:
            self.bytes -= len(self.pending.pop(0).data)

    def for_draft(self, drafter: Placement) -> list[common_pb2.Features]:
        """The features the next Draft carries: those waiting, when the replica it goes to
        is a head drafter; none otherwise."""
        replica = drafter.replica
        if replica is None or replica.info is None or not replica.info.HasField("features"):
            return []
        return self.pending

    def delivered(self) -> None:
        """A Draft was answered with the waiting features: the drafter keeps them now."""
        self.pending, self.bytes = [], 0
