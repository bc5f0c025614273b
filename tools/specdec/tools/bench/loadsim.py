"""The speculation policy under load, simulated: stand-in replicas with a measured cost surface.

What the gateway's policy decides at each concurrency, without models and without the wall
clock. Sessions run the gateway's rounds (specdec.gateway.round.loop) against a simulated
verifier and drafter; only time is simulated:

- The verifier batches continuously, as a replica does (specdec.replica.batching): when
  its model is free it runs one forward over every Verify waiting (at most `max_rows`),
  padded to the widest row, and that forward takes the surface's t(rows, widest) (`Surface`).
  It fits its cost curve from those forwards with the replica's own code
  (specdec.common.cost.CostCurve, seeded by the replica's start-up probe of one row),
  keeps its load window (`LoadWindow`), and every response carries both through the wire
  format (`to_proto` / `ReportedCost.from_proto`), as a real Verify response does.
- The drafter is a second such replica: a Draft of k tokens is k steps, each step one
  batched forward over the Drafts in progress.
- Each session runs requests of `request_tokens` tokens, each with its own policy
  (specdec.gateway.round.policy: adaptive, or fixed k), sharing the gateway's `SourcePriors`,
  and feeds it each round's `Outcome` as the loop does. Draft tokens are accepted i.i.d.
  at `acceptance`; a round's call pays `overhead_ms` of round trip beyond the forwards.
  Each forward's time varies by `jitter` (uniform, +-5% by default): without it, sessions
  lock into phases that a real stack's noise breaks (4 sessions at k = 5 verified 1.45 rows
  a forward, at k = 4 two).

`run` gives a `Result` per concurrency and mode (aggregate tokens per second of simulated
time, the mean k chosen, the verifier's mean rows per forward); `sweep` runs adaptive, k = 0
and each fixed k. ``python -m specdec.tools.bench.loadsim`` prints the table that
docs/concepts/cost-model.md quotes.

The surfaces: two measured ones, the 1.5B target's forwards per shape on a 2-vCPU Xeon
without bf16 units (docs/bench/2026-11-27-engine-shapes/results.json: float32 with packed
weights, the layout the calibration keeps there, and bfloat16), read through the tokens a
forward computes (rows x widest row), which is what those measurements follow (8 rows of
one token cost what one row of 8 or 9 does); and one modelled GPU (a 7 ms step, flat to 64
tokens a forward, then 0.03 ms a token), labelled as modelled. And one ragged surface:
llama.cpp's forwards of the same target's Q4_K_M GGUF on a 2-vCPU AMD EPYC (Zen 4)
(docs/bench/2026-11-28-llamacpp-shapes), which cost the tokens their rows compute (no
pads), with a drafter as dear as the target there (`DRAFT_SHARE`).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from specdec.common.cost import CostCurve, LoadWindow, ReportedCost, to_proto
from specdec.gateway.outcome import DRAFTED, NO_DRAFT, Outcome
from specdec.gateway.round.policy import AdaptivePolicy, FixedPolicy, GoodputGuard, SourcePriors
from specdec.gateway.round.policy.guard import GuardMode, Ticket

BENCH = Path(__file__).resolve().parents[4] / "docs/bench"
SHAPES = BENCH / "2026-11-27-engine-shapes/results.json"
LLAMACPP_SHAPES = BENCH / "2026-11-28-llamacpp-shapes/results.json"
# A drafter step over the target's, per surface where it is not Setup's quarter: on
# llama.cpp the 0.5B GGUF's step (56 ms) was the 1.5B's (57 ms) on the machine of its shapes
# (`specdec up` on an AMD EPYC Zen 4, 2 vCPUs, --engine auto's measurement).
DRAFT_SHARE = {"cpu-llamacpp": 1.0}
CONCURRENCY = (1, 2, 4, 8, 16, 32)
PROBE_WIDTHS = (1, 2, 4, 8, 16)  # the replica's start-up probe (one row)


@dataclass(frozen=True)
class Surface:
    """A forward's cost, t(rows, tokens a row) in ms, read through the tokens it computes
    (rows x tokens): piecewise linear between the measured points (made non-decreasing),
    the last segment's slope beyond them."""

    name: str
    points: tuple[tuple[int, float], ...]  # (tokens a forward computes, ms), by tokens
    measured: bool = True
    # No pads (llama.cpp): a forward computes its rows' tokens, not rows x widest, and its
    # replica fits and reports one line over them (specdec.common.cost, "ragged").
    ragged: bool = False

    @classmethod
    def from_shapes(cls, name: str, cells: dict[str, float], ragged: bool = False) -> Surface:
        """From "<rows>x<tokens>": ms cells (the shapes bench's results.json)."""
        by_tokens: dict[int, list[float]] = {}
        for shape, ms in cells.items():
            rows, tokens = (int(x) for x in shape.split("x"))
            by_tokens.setdefault(rows * tokens, []).append(ms)
        points, top = [], 0.0
        for tokens in sorted(by_tokens):
            top = max(top, sum(by_tokens[tokens]) / len(by_tokens[tokens]))
            points.append((tokens, top))
        return cls(name, tuple(points), ragged=ragged)

    def ms(self, rows: int, tokens: int) -> float:
        n = rows * tokens
        pts = self.points
        if n <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + (y1 - y0) / (x1 - x0) * (n - x1)

    def scaled(self, factor: float, name: str) -> Surface:
        points = tuple((n, ms * factor) for n, ms in self.points)
        return Surface(name, points, self.measured, self.ragged)


def surfaces() -> dict[str, Surface]:
    """The measured CPU surfaces and the modelled GPU one (the module docstring)."""
    cells = json.loads(SHAPES.read_text())["ms"]
    llama = json.loads(LLAMACPP_SHAPES.read_text())["ms"]["llama.cpp"]
    return {
        "cpu-float32-packed": Surface.from_shapes("cpu-float32-packed", cells["float32+packed"]),
        "cpu-bfloat16": Surface.from_shapes("cpu-bfloat16", cells["bfloat16"]),
        "cpu-llamacpp": Surface.from_shapes("cpu-llamacpp", llama, ragged=True),
        "gpu-modelled": Surface(
            "gpu-modelled", ((1, 7.0), (64, 7.0), (256, 12.76), (1024, 35.8)), measured=False
        ),
    }


@dataclass(frozen=True)
class Setup:
    """One simulated deployment."""

    target: Surface
    draft_share: float = 0.25  # a drafter step over the target's at the same shape
    acceptance: float = 0.75  # of each draft token, i.i.d.
    overhead_ms: float = 1.0  # a call's round trip beyond the forward (network, gateway)
    jitter: float = 0.1  # each forward's time varies uniformly by this share (+- half)
    max_rows: int = 32  # rows a forward holds at most (the replicas' --max-batch-size)
    request_tokens: int = 64  # tokens of each request (then a new one, a new policy)
    # A verifier forward of rows wider than one token takes this share more than its
    # replica reports: a stand-in for the costs of a speculating round that the adaptive
    # policy does not price (the guard's test; 0 elsewhere).
    unpriced: float = 0.0


def setup_of(surface: Surface, **kwargs: Any) -> Setup:
    """The deployment a surface was measured in: its drafter's share (DRAFT_SHARE)."""
    kwargs.setdefault("draft_share", DRAFT_SHARE.get(surface.name, Setup.draft_share))
    return Setup(surface, **kwargs)


@dataclass
class Replica:
    """A simulated replica: its model's queue, its fitted curve and load window, and the
    cost it last reported (what the gateway's Replica keeps)."""

    surface: Surface
    max_rows: int
    curve: CostCurve = field(init=False)
    window: LoadWindow = field(default_factory=LoadWindow)
    queue: list[Any] = field(default_factory=list)
    busy_until: float = -1.0
    cost: ReportedCost | None = None

    def __post_init__(self) -> None:
        self.curve = CostCurve(ragged=self.surface.ragged)
        # The start-up probe: one row of each width (a replica's probe_cost).
        points = [(n, self.surface.ms(1, n)) for n in PROBE_WIDTHS]
        self.curve.seed(points)
        self.report(0.0)

    def report(self, now: float) -> None:
        load = self.window.load(now, len(self.queue) + (now < self.busy_until))
        message = to_proto(self.curve.buckets(), load, self.surface.ragged, self.curve.points())
        self.cost = ReportedCost.from_proto(message)

    def forward(
        self,
        rows: int,
        widest: int,
        now: float,
        noise: float = 1.0,
        computed: int = 0,
        unpriced: float = 0.0,
    ) -> float:
        """Run one forward now, `noise` times the surface's time: its seconds (fitted
        and counted), and `unpriced` times them more that it neither fits nor counts.
        `computed`: the rows' tokens, what a ragged forward costs."""
        if self.surface.ragged:
            seconds = self.surface.ms(1, computed) / 1e3 * noise
            self.curve.add(computed, rows, seconds)
            self.window.add(now + seconds, seconds, rows, widest, computed)
        else:
            seconds = self.surface.ms(rows, widest) / 1e3 * noise
            self.curve.add(widest, rows, seconds)
            self.window.add(now + seconds, seconds, rows, widest)
        seconds *= 1.0 + unpriced
        self.busy_until = now + seconds
        return seconds


@dataclass
class _Session:
    index: int
    rng: random.Random
    policy: Any = None
    generated: int = 0  # tokens of the current request
    rounds: int = 0  # of the current request
    k: int = 0
    draft_steps: int = 0  # steps its Draft still needs
    draft_sent: float = 0.0
    draft_ms: float = 0.0
    draft_seconds: float = 0.0
    round_started: float = 0.0
    verify_sent: float = 0.0
    queue_depth: int = 0
    ticket: Ticket | None = None  # the guard's, for the round in progress


@dataclass(frozen=True)
class Result:
    concurrency: int
    mode: str  # "adaptive" or "k=<n>"
    tokens_per_s: float
    mean_k: float  # draft tokens per round
    rows_per_forward: float  # the verifier's, over the measured span
    k_counts: tuple[int, ...] = ()  # rounds by k


class _Sim:
    def __init__(
        self,
        setup: Setup,
        concurrency: int,
        make_policy: Callable[[], Any],
        seed: int,
        guarded: bool = False,
        gateways: int = 1,
    ):
        self.setup = setup
        self.make_policy = make_policy
        self.now = 0.0
        # The gateway's goodput guard over the sessions' rounds, on simulated time; with
        # `gateways` replicas each guarding its own sessions (session i on replica i mod
        # gateways), one guard per replica: the guard before replicas shared it
        # (specdec.gateway.round.policy.shared).
        self.guards = [
            GoodputGuard(clock=lambda: self.now) for _ in range(gateways if guarded else 0)
        ]
        self.verifier = Replica(setup.target, setup.max_rows)
        self.drafter = Replica(setup.target.scaled(setup.draft_share, "drafter"), setup.max_rows)
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = 0
        self.sessions = [_Session(i, random.Random(seed * 1000 + i)) for i in range(concurrency)]
        self.rng = random.Random(seed)  # the forwards' jitter
        self.tokens = 0
        self.rounds = 0
        self.k_sum = 0
        self.k_counts: list[int] = []
        self.forwards = 0
        self.rows = 0

    # -- events --------------------------------------------------------------------------

    def at(self, time: float, kind: str, payload: Any = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, kind, payload))

    def run(self, rounds: int, warm: int) -> tuple[float, float]:
        """Until `rounds` rounds per session; (tokens per second, rows per forward) over the
        rounds after the first `warm` per session."""
        for s in self.sessions:
            self._new_request(s)
            self.at(0.0, "round", s)
        start_rounds = warm * len(self.sessions)
        end_rounds = rounds * len(self.sessions)
        t0 = tokens0 = forwards0 = rows0 = None
        now = 0.0
        while self.events and self.rounds < end_rounds:
            now, _, kind, payload = heapq.heappop(self.events)
            self.now = now
            getattr(self, "_" + kind)(now, payload)
            if t0 is None and self.rounds >= start_rounds:
                t0, tokens0, forwards0, rows0 = now, self.tokens, self.forwards, self.rows
                self.k_sum, self.k_counts = 0, []
        assert t0 is not None and tokens0 is not None
        assert forwards0 is not None and rows0 is not None
        forwards = self.forwards - forwards0
        return (
            (self.tokens - tokens0) / (now - t0),
            (self.rows - rows0) / forwards if forwards else 0.0,
        )

    def _guard(self, s: _Session) -> GoodputGuard:
        """The guard of the replica serving session `s`."""
        return self.guards[s.index % len(self.guards)]

    def _new_request(self, s: _Session) -> None:
        s.policy = self.make_policy()
        s.generated = s.rounds = 0
        placement = SimpleNamespace
        s.policy.bind(placement(replica=self.drafter), placement(replica=self.verifier))

    def _round(self, now: float, s: _Session) -> None:
        half = self.setup.overhead_ms / 2e3
        remaining = self.setup.request_tokens - s.generated
        max_k = max(0, min(MAX_K, remaining - 1))
        s.ticket = self._guard(s).begin(s.index) if self.guards else None
        if s.ticket is not None and s.ticket.mode == GuardMode.PLAIN:
            max_k = 0
        s.k = s.policy.choose_k(max_k)
        s.round_started = now
        if s.k:
            s.draft_sent, s.draft_steps, s.draft_ms = now, s.k, 0.0
            self.at(now + half, "arrive", (self.drafter, s))
        else:
            s.draft_seconds = 0.0
            s.verify_sent = now
            self.at(now + half, "arrive", (self.verifier, s))

    def _arrive(self, now: float, payload: tuple[Replica, _Session]) -> None:
        replica, s = payload
        if replica is self.verifier:
            s.queue_depth = len(replica.queue) + (now < replica.busy_until)
        replica.queue.append(s)
        if now >= replica.busy_until:
            self._start(now, replica)

    def _start(self, now: float, replica: Replica) -> None:
        if not replica.queue or now < replica.busy_until:
            return
        batch = replica.queue[: self.setup.max_rows]
        del replica.queue[: len(batch)]
        widths = [1 + s.k if replica is self.verifier else 1 for s in batch]
        noise = 1.0 + self.setup.jitter * (self.rng.random() - 0.5)
        hidden = self.setup.unpriced if replica is self.verifier and max(widths) > 1 else 0.0
        seconds = replica.forward(len(batch), max(widths), now, noise, sum(widths), hidden)
        if replica is self.verifier:
            self.forwards += 1
            self.rows += len(batch)
        self.at(now + seconds, "done", (replica, batch, seconds))

    def _done(self, now: float, payload: tuple[Replica, list[_Session], float]) -> None:
        replica, batch, seconds = payload
        replica.report(now)  # what its responses carry
        half = self.setup.overhead_ms / 2e3
        for s in batch:
            if replica is self.verifier:
                self.at(now + half, "verdict", (s, seconds))
                continue
            s.draft_ms += seconds * 1e3
            s.draft_steps -= 1
            if s.draft_steps:
                replica.queue.append(s)  # its next step
            else:
                s.draft_seconds = now + half - s.draft_sent
                s.verify_sent = now + half
                self.at(now + self.setup.overhead_ms / 1e3, "arrive", (self.verifier, s))
        self._start(now, replica)

    def _verdict(self, now: float, payload: tuple[_Session, float]) -> None:
        s, forward_s = payload
        accepted = 0
        while accepted < s.k and s.rng.random() < self.setup.acceptance:
            accepted += 1
        o = Outcome(
            index=s.rounds, max_k=MAX_K, k=s.k, draft=tuple(range(s.k)), accepted=accepted,
            next_token=0, source=DRAFTED if s.k else NO_DRAFT,
            draft_seconds=s.draft_seconds, verify_seconds=now - s.verify_sent,
            queue_depth=s.queue_depth, resends=0, seconds=now - s.round_started,
            verify_forward_ms=forward_s * 1e3, verify_fed=1 + s.k,
            draft_forward_ms=s.draft_ms if s.k else 0.0, draft_fed=1 if s.k else 0,
        )  # fmt: skip
        s.policy.observe(o)
        if s.ticket is not None:
            self._guard(s).end(s.index, s.ticket, accepted + 1, o.seconds)
        self.rounds += 1
        self.tokens += accepted + 1
        self.k_sum += s.k
        while len(self.k_counts) <= s.k:
            self.k_counts.append(0)
        self.k_counts[s.k] += 1
        s.rounds += 1
        s.generated += accepted + 1
        if s.generated >= self.setup.request_tokens:
            self._new_request(s)
        self.at(now, "round", s)


MAX_K = 5  # the request's k: the adaptive policy's bound, and the largest fixed k swept


def run(
    setup: Setup,
    concurrency: int,
    mode: str,
    rounds: int = 120,
    warm: int = 20,
    seed: int = 1,
    gateways: int = 1,
) -> Result:
    """One simulated run: `mode` "adaptive" (one SourcePriors for the gateway),
    "guarded" (adaptive under the gateway's GoodputGuard: one over every session, or one
    per replica of `gateways`, each over its own) or "k=<n>" (a fixed policy at k = n)."""
    if mode in ("adaptive", "guarded"):
        priors = SourcePriors()

        def make() -> Any:
            return AdaptivePolicy(ssd=False, max_fan_out=1, priors=priors)
    else:
        k = int(mode.removeprefix("k="))

        class _Fixed(FixedPolicy):
            def choose_k(self, max_k: int) -> int:
                return min(k, max_k)

        def make() -> Any:
            return _Fixed()

    sim = _Sim(setup, concurrency, make, seed, guarded=mode == "guarded", gateways=gateways)
    tokens_per_s, rows = sim.run(rounds, warm)
    measured = sum(sim.k_counts)
    return Result(
        concurrency,
        mode,
        tokens_per_s,
        sim.k_sum / measured if measured else 0.0,
        rows,
        tuple(sim.k_counts),
    )


def sweep(
    setup: Setup,
    concurrency: Sequence[int] = CONCURRENCY,
    fixed: Sequence[int] = tuple(range(MAX_K + 1)),
    **kwargs: Any,
) -> dict[int, dict[str, Result]]:
    """Adaptive and each fixed k at each concurrency: {concurrency: {mode: Result}}."""
    modes = ["adaptive", *(f"k={k}" for k in fixed)]
    return {c: {m: run(setup, c, m, **kwargs) for m in modes} for c in concurrency}


def table(name: str, results: dict[int, dict[str, Result]]) -> str:
    """A markdown table of a sweep: tokens per second per mode, the best fixed k, the
    adaptive policy's mean k and its ratios."""
    fixed = [m for m in next(iter(results.values())) if m != "adaptive"]
    head = ["concurrency", *fixed, "best fixed", "adaptive", "its mean k", "/ k=0", "/ best"]
    lines = [f"**{name}**", "", "| " + " | ".join(head) + " |", "|" + "--:|" * len(head)]
    for c, row in results.items():
        best = max(fixed, key=lambda m: row[m].tokens_per_s)
        a = row["adaptive"]
        cells = [
            str(c),
            *(f"{row[m].tokens_per_s:.2f}" for m in fixed),
            best,
            f"{a.tokens_per_s:.2f}",
            f"{a.mean_k:.2f}",
            f"{a.tokens_per_s / row['k=0'].tokens_per_s:.2f}x",
            f"{a.tokens_per_s / row[best].tokens_per_s:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def guard_replicas(
    setup: Setup,
    concurrency: int,
    gateways: Sequence[int] = (1, 2, 4),
    seeds: Sequence[int] = (1, 2, 3),
    rounds: int = 300,
) -> str:
    """A markdown table: the guarded policy over k = 0, and its mean k, per seed, with the
    sessions split over each number of gateway replicas guarding their own (1: one guard
    over every session, what the replicas share through Redis)."""
    head = ["seed", *(f"{g} {'guard' if g == 1 else 'guards'}" for g in gateways)]
    lines = ["| " + " | ".join(head) + " |", "|" + "--:|" * len(head)]
    for seed in seeds:
        k0 = run(setup, concurrency, "k=0", rounds=rounds, seed=seed).tokens_per_s
        cells = [str(seed)]
        for g in gateways:
            r = run(setup, concurrency, "guarded", rounds=rounds, seed=seed, gateways=g)
            cells.append(f"{r.tokens_per_s / k0:.3f}x (k {r.mean_k:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.tools.bench.loadsim")
    parser.add_argument("--surface", action="append", help="default: every surface")
    parser.add_argument("--acceptance", type=float, default=Setup.acceptance)
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument(
        "--guard-replicas",
        type=int,
        metavar="SESSIONS",
        help="instead of the sweep: the guarded policy at SESSIONS sessions under one guard "
        "and under a guard per gateway replica (2 and 4 replicas), over k = 0, 300 rounds",
    )
    parser.add_argument(
        "--unpriced",
        type=float,
        default=Setup.unpriced,
        help="drafted verifier forwards take this share more than the verifier reports",
    )
    args = parser.parse_args(argv)
    if args.guard_replicas:
        for name in args.surface or ["cpu-float32-packed"]:
            setup = setup_of(surfaces()[name], unpriced=args.unpriced)
            print(f"**{name}**, {args.guard_replicas} sessions, unpriced {args.unpriced}\n")
            print(guard_replicas(setup, args.guard_replicas) + "\n")
        return
    for name, surface in surfaces().items():
        if args.surface and name not in args.surface:
            continue
        setup = setup_of(surface, acceptance=args.acceptance, unpriced=args.unpriced)
        label = f"{name} ({'measured' if surface.measured else 'modelled'}), " + (
            f"acceptance {args.acceptance}"
        )
        print(table(label, sweep(setup, rounds=args.rounds)) + "\n")


if __name__ == "__main__":
    main()
