"""What each round drafts: the source, its length (0 included) and the SSD fan-out (k_policy).

- `FixedPolicy` (fixed.py) drafts what it is given: the request's k every round, lookups
  and extensions whole, the configured fan-out.
- `AdaptivePolicy` (adaptive.py, the default) picks each round's draft to maximise
  expected tokens per second; its docstring has the model. Its parts: what drafts of each
  source yield (acceptance.py), what a round costs, from the replicas' reported cost and
  load (prices.py), and SSD's fan-out (fanout.py); its constants (params.py).
- `GoodputGuard` (guard.py): the gateway's epochs of speculation on and off under load,
  measured, for every adaptive request; the faster mode runs at each load level.
- `SharedGuard` (shared.py): one such guard for all of a gateway's replicas, kept through
  Redis: one replica leads and counts every replica's rounds, the others follow it.

The modules import down this list: params, guard; acceptance, trees, shared; prices,
fanout; fixed; adaptive.
"""

from __future__ import annotations

from specdec.gateway.names import KPolicy
from specdec.gateway.round.policy.acceptance import SourcePriors
from specdec.gateway.round.policy.adaptive import AdaptivePolicy
from specdec.gateway.round.policy.fixed import FixedPolicy
from specdec.gateway.round.policy.guard import GoodputGuard, GuardMode, GuardParams, RoundGuard
from specdec.gateway.round.policy.params import Estimate, PolicyParams

__all__ = [
    "ADAPTIVE",
    "ADAPTIVE_MAX_FAN_OUT",
    "BY_NAME",
    "FIXED",
    "AdaptivePolicy",
    "Estimate",
    "FixedPolicy",
    "GoodputGuard",
    "GuardMode",
    "GuardParams",
    "Policy",
    "PolicyParams",
    "RoundGuard",
    "SourcePriors",
    "make_policy",
    "parse_policy",
]

# The gateway_pb2.KPolicy values (a request's, the configuration's).
FIXED = KPolicy.FIXED.proto
ADAPTIVE = KPolicy.ADAPTIVE.proto
BY_NAME = {policy.value: policy.proto for policy in KPolicy}
# The largest fan-out the adaptive policy asks for when the gateway's --ssd-fan-out is 0:
# the drafter's default --ssd-fan-out (replicas do not report theirs).
ADAPTIVE_MAX_FAN_OUT = 6

Policy = FixedPolicy | AdaptivePolicy


def parse_policy(name: str) -> int:
    """'fixed' / 'adaptive' -> the KPolicy value; ValueError naming the choices."""
    try:
        return BY_NAME[name.strip().lower()]
    except KeyError:
        raise ValueError(f"must be one of {', '.join(BY_NAME)}, got {name!r}") from None


def make_policy(
    kind: KPolicy, ssd: bool, fan_out: int, priors: SourcePriors | None = None
) -> Policy:
    """The request's policy. fan_out: the gateway's --ssd-fan-out (0: the drafter's
    default, which the adaptive policy takes as ADAPTIVE_MAX_FAN_OUT, its largest)."""
    if kind == KPolicy.ADAPTIVE:
        return AdaptivePolicy(ssd, fan_out or ADAPTIVE_MAX_FAN_OUT, priors=priors)
    return FixedPolicy(fan_out, priors)
