"""What a round costs (`Prices`): the verifier's and the drafter's reported cost curves and
loads, read for the request's placements, and what this request measured of its own calls
(round trips, the forwards' times against the curves). The adaptive policy's T(d), V(n) and
D(k), and its saturation u, are these (specdec.gateway.round.policy.adaptive's docstring
has the model)."""

from __future__ import annotations

from typing import Any

from specdec.common.cost import Line, Load, ReportedCost
from specdec.gateway.names import Role
from specdec.gateway.round.policy.acceptance import Ema
from specdec.gateway.round.policy.params import PolicyParams

# A call that fed more tokens than this (a prefill, a resend) is not a measurement of a
# round's cost (the replicas' curves stop there too, specdec.common.cost).
MAX_FED = 32


class Prices:
    """The request's prices: the replicas' reports and its own measurements."""

    def __init__(self, params: PolicyParams) -> None:
        self.p = p = params
        self.verify = Ema(p.smoothing)  # v: seconds of a Verify without a draft (no curve)
        self.draft = Ema(p.smoothing)  # d_t: seconds per drafted token (its forwards)
        self.draft_overhead = Ema(p.smoothing)  # o_d: a Draft's round trip beyond them
        self.queue = Ema(p.smoothing)  # the verifier's reported queue depth
        self.overhead = Ema(p.smoothing)  # o: a Verify's round trip beyond its forward
        self.scale = Ema(p.smoothing)  # r: reported forward time over the curve's
        self.round = Ema(p.smoothing)  # seconds of one of this request's rounds
        self._drafter: Any = None  # the request's Placements (their replica's reported cost)
        self._verifier: Any = None
        self._fleet: Any = None  # the gateway's pools: the cost before a placement has a replica

    def bind(self, drafter: Any, verifier: Any, fleet: Any = None) -> None:
        """The request's placements (specdec.gateway.fleet.caller.Placement): the curves
        their replica reports; before the first call has placed one, the curve of the
        replica the fleet's pool would pick (specdec.gateway.fleet.replicas.Fleet), so the
        first round is priced too."""
        self._drafter, self._verifier, self._fleet = drafter, verifier, fleet

    # -- the replicas' reports -----------------------------------------------------------------

    def _cost(self, placement: Any, role: str) -> ReportedCost | None:
        replica = getattr(placement, "replica", None)
        if replica is None and self._fleet is not None:
            cost: ReportedCost | None = self._fleet.pool(role).cost(
                getattr(placement, "rule", None)
            )
            return cost
        return getattr(replica, "cost", None)

    @property
    def verifier(self) -> ReportedCost | None:
        """The verifier's reported cost (None: not reported)."""
        return self._cost(self._verifier, Role.VERIFIER)

    @property
    def drafter(self) -> ReportedCost | None:
        """The drafter's reported cost (None: not reported)."""
        return self._cost(self._drafter, Role.DRAFTER)

    def verifier_load(self) -> Load | None:
        """The verifier's load as it last reported it (None: not reported)."""
        cost = self.verifier
        return cost.load if cost is not None else None

    @property
    def token_cost(self) -> float:
        """g without a cost curve: the share of a step one more token costs, from the load."""
        g0 = self.p.idle_token_cost
        load = self.queue.value or 0.0
        saturation = min(1.0, load / self.p.saturation_queue) if self.p.saturation_queue else 1.0
        return g0 + (1.0 - g0) * saturation

    @property
    def rows(self) -> float:
        """R: the rows a forward of the verifier holds: the mean of its forwards over the
        last seconds as it reports them, else 1 + the queue depth it reported."""
        load = self.verifier_load()
        if load is not None and load.forwards > 0:
            return max(1.0, load.rows_per_forward)
        return 1.0 + round(self.queue.value or 0.0)

    @property
    def saturation(self) -> float:
        """u: the share of the verifier's time that other sessions' rows use: its busy
        share times the share of the rows it served that were not this request's (0 when
        it reports no load). Before this request has a round, its share is one row of
        the forwards the verifier reports: a request that starts under load is priced
        as one (priced idle, every new request drafted into a full verifier)."""
        load = self.verifier_load()
        if load is None or load.rows_per_second <= 0:
            return 0.0
        if not self.round.value:
            return load.busy * max(0.0, 1.0 - 1.0 / max(1.0, load.rows_per_forward))
        own = 1.0 / self.round.value  # this request's rows per second (one per round)
        return load.busy * max(0.0, 1.0 - own / load.rows_per_second)

    def verifier_line(self) -> Line | None:
        """The verifier's reported t_v for the rows its load puts in a forward (the
        bucket's line; `forward_ms` reads the surface between buckets)."""
        cost = self.verifier
        return cost.line(round(self.rows)) if cost is not None else None

    def forward_ms(self, tokens: int) -> float | None:
        """t_v(R, n) in ms as reported (None: no curve)."""
        cost = self.verifier
        return cost.ms(self.rows, tokens) if cost is not None else None

    @property
    def _scale(self) -> float:
        return self.scale.value if self.scale.value is not None else 1.0

    # -- the prices ----------------------------------------------------------------------------

    def verify_time(self, tokens: int) -> float | None:
        """V(n): seconds of a Verify that feeds n tokens; None before anything is known."""
        ms = self.forward_ms(tokens)
        if ms is not None:
            return (self.overhead.value or 0.0) + self._scale * ms / 1e3
        if self.verify.value is None:
            return None
        return self.verify.value * (1.0 + self.token_cost * (tokens - 1))

    def price(self, tokens: int, drafting: float = 0.0, width: int = 1, steps: int = 0) -> float:
        """T: what a round that verifies `tokens` tokens after `drafting` seconds of
        drafting (`steps` drafter forwards) costs: its own time V(n) + drafting idle;
        saturated, the batch's forward at the batch width W (`width`, tokens a row) and,
        beyond it, the marginal time its tokens add to that forward, once for every row
        that waits for it; on a ragged verifier, the replicas' time a round when every
        session runs rounds like it (`network_time`). u weighs the two (the adaptive
        policy's docstring)."""
        verify = self.verify_time(tokens)
        assert verify is not None
        own = verify + drafting
        cost = self.verifier
        u = self.saturation if cost is not None else 0.0
        if cost is None or u <= 0.0:
            return own
        if cost.ragged:
            return (1.0 - u) * own + u * self.network_time(tokens, steps)
        forward = cost.ms(self.rows, tokens)
        at_width = cost.ms(self.rows, max(1, width))
        beyond = max(0.0, forward - at_width)
        batch = self._scale * (max(forward, at_width) + (self.rows - 1.0) * beyond) / 1e3
        return (1.0 - u) * own + u * batch

    @property
    def sessions(self) -> float:
        """S: the sessions sharing the replicas, as their loads show them: the rows of the
        verifier's forwards and, while the drafter is busy, the rows of its forwards."""
        rows = self.rows
        cost = self.drafter
        load = cost.load if cost is not None else None
        if load is not None and load.forwards > 0:
            rows += load.busy * max(1.0, load.rows_per_forward)
        return rows

    def network_time(self, tokens: int, steps: int) -> float:
        """S / X: seconds of the replicas a round costs when the S sessions sharing them
        all run rounds like it (`tokens` verified a row, `steps` drafter forwards before):
        the sessions split between the verifier's queue (x rows a forward of t_v(x, n))
        and the drafter's (S - x rows, `steps` forwards of t_d(S - x, 1) a round) so that
        both pass as many rounds a second, and X is that rate."""
        verifier = self.verifier
        assert verifier is not None
        scale = self._scale
        total = max(1.0, self.sessions)

        def verify_ms(rows: float) -> float:
            return scale * verifier.batch_ms(rows, tokens)

        drafter = self.drafter
        if steps <= 0 or drafter is None:
            return verify_ms(total) / 1e3
        lo, hi = min(1.0, total), total
        for _ in range(30):  # rounds a second through the verifier rise with x, the drafter's fall
            x = (lo + hi) / 2
            drafting = max(total - x, 1e-9)
            if x / verify_ms(x) < drafting / (steps * drafter.batch_ms(max(drafting, 1.0), 1)):
                lo = x
            else:
                hi = x
        x = (lo + hi) / 2
        return total * verify_ms(x) / x / 1e3

    def drafter_wait(self) -> float:
        """w_d: seconds a Draft would wait in the drafter's queue, from the load it
        reports: its waiting requests over its rows per forward, times its mean forward
        (0 when it reports none)."""
        cost = self.drafter
        load = cost.load if cost is not None else None
        if load is None or not load.waiting or load.forwards <= 0:
            return 0.0
        return load.waiting / max(1.0, load.rows_per_forward) * load.forward_s

    def draft_time(self) -> float | None:
        """d_t: seconds per model draft token; None before anything is known."""
        if self.draft.value is not None:
            return self.draft.value
        cost = self.drafter
        return cost.line(1).ms(1) / 1e3 if cost is not None else None

    def draft_cost(self, k: int) -> float:
        """D(k): seconds of a Draft of k tokens, max(o_d, w_d) + k d_t (0 for k = 0); o_d
        is the Draft's measured round trip beyond its forwards, before one the Verify's;
        w_d the wait the drafter's reported queue promises now."""
        if k <= 0:
            return 0.0
        d = self.draft_time() or 0.0
        return max(self.draft_overhead_s, self.drafter_wait()) + k * d

    @property
    def draft_overhead_s(self) -> float:
        """o_d: a Draft's round trip beyond its forwards, before one the Verify's (0 before
        either)."""
        fixed = self.draft_overhead.value
        return (self.overhead.value or 0.0) if fixed is None else fixed

    # -- measurements --------------------------------------------------------------------------

    def observe_draft(self, k: int, seconds: float, forward_ms: float = 0.0, fed: int = 0) -> None:
        """A Draft of k tokens that ran the model took `seconds` (round trip), forward_ms of
        it in the drafter's forwards as it reported (0: not known: all of it per token),
        after feeding `fed` new tokens. A Draft that fed more than MAX_FED (the prompt's
        prefill, a resend after a miss) says nothing of the cost of drafting: skipped."""
        if k <= 0 or fed > MAX_FED:
            return
        if forward_ms > 0:
            self.draft.add(forward_ms / 1e3 / k)
            self.draft_overhead.add(max(0.0, seconds - forward_ms / 1e3))
        else:
            self.draft.add(seconds / k)

    def observe_verify(
        self, k: int, seconds: float, queue: int, forward_ms: float = 0.0, fed: int = 0
    ) -> None:
        """A Verify of k draft tokens took `seconds` (round trip), forward_ms of it in the
        verifier's forward as it reported (0: not known) after feeding `fed` tokens, and
        the verifier reported `queue` waiting."""
        self.queue.add(float(queue))
        predicted = self.forward_ms(fed) if 0 < fed <= MAX_FED else None
        if predicted is not None and forward_ms > 0:
            self.overhead.add(max(0.0, seconds - forward_ms / 1e3))
            if predicted > 0:
                self.scale.add(forward_ms / predicted)
        self.verify.add(seconds / (1.0 + self.token_cost * k))
