"""A replica's forward cost curve, measured where it runs (torch-free).

Whether a speculation round pays depends on what verifying n tokens costs on this replica.
The curve is t(n) = a + b·n milliseconds for a forward that feeds n tokens per row, one fit
per batch bucket (the rows in the forward: 1, 2-3, 4-7, 8-15, 16+):

- a: what every forward costs whatever it feeds (reading the weights, launching kernels, the
  framework's own work);
- b: what each further token costs. Near 0 where a forward is memory-bound (an idle GPU, a
  CPU with bf16 matrix units at a few tokens); a real share of a step where it is
  compute-bound (an AVX2 CPU, a bf16 model on a CPU without bf16 units, a GPU already full
  of other sessions' tokens).

`CostCurve` fits it online from the forwards the replica runs anyway (`add`): a weighted
least squares whose sums decay by `decay` per forward (the recent past counts most, so the
curve follows a change of load or clock), with each forward weighted down by how far it is
from the current fit (a Huber weight: a forward stalled by a page fault or a noisy
neighbour moves the fit little). Only forwards of at most `max_tokens` tokens a row are
fitted: the decode and verify range speculation lives in. A long prefill chunk is
compute-bound on every device, and a line through it would overstate b at a few tokens.

The one-token forward is fitted apart: t(1) is its own decayed, Huber-weighted mean (the
`step`), and the line is fitted through forwards of 2 tokens or more. A device may run a
one-token forward on another path than a wider one: on a CPU without bf16 matrix units, a
bfloat16 1.5B model took 535 ms for one token, 957 ms for two and 1,167 ms for four, where
one line through all of them put t(1) at 713 ms and t(2) at 870 ms, pricing the first
verified draft token at a fifth of a step when it cost four fifths. Where the paths do not
differ (a GPU, float32 on most CPUs) the step lies on the line and nothing changes.

While a bucket has seen one kind of forward only (a verifier serving k = 0 sees n = 1; a
bucket may see one width of 2 or more), what it has not seen is taken from the `prior`
(the start-up probe's fit, see specdec.replica.replica) scaled to what it has. The replicas
report their curve in every Draft and Verify response and in Info (`ForwardCost`), so a
gateway that has never sent this replica a request already knows it.

The buckets together are a surface over rows and tokens a row: each reports the mean rows
of the forwards behind it (`Line.rows`), and the gateway reads t(rows, n) between two
buckets by interpolating in rows (`ReportedCost.ms`). Where a bucket of several rows has
never run a one-token forward (every session speculated), its step is the probe's shape
scaled, which says nothing of what R rows of one token cost; a forward's cost follows the
tokens it computes (on the 1.5B target on a CPU, 8 rows of 1 token took 841 ms and one row
of 9 tokens 832: docs/benchmarks/2026-11-27-engine-shapes.md), so the reader takes it from
the one-row line at R tokens instead (`step_samples` says which).

An engine that batches without pads (llama.cpp: a forward's rows are the tokens of every
sequence laid end to end) costs the tokens it computes, whatever the rows: 8 rows of one
token cost what one row of 8 does, and a row of 5 beside seven of 1 costs 12 tokens, not 40.
Its curve is over a forward's tokens (`CostCurve(ragged=True)` fits every forward in the
one-row bucket at the tokens it computed, up to `RAGGED_MAX_TOKENS`), and its reports say so
(`ForwardCost.ragged`): the reader prices R rows at the tokens they compute, its own row's
and the others' (`ReportedCost.ms`). That cost is not a line: on llama.cpp's CPU kernels the
1.5B Q4_K_M GGUF took 57 ms for one token, 450 for 8 and 505 for 16 (a token costs half as
much from about 16 tokens a forward), so a ragged curve also keeps a measured point per
range of tokens (`RAGGED_EDGES`, seeded by the start-up probe), and the reader interpolates
between them.

With the curve the replica reports its load (`Load`, from `LoadWindow`): what its model did
over the last seconds (busy share, rows and tokens per forward, rows per second) and the
model requests waiting now. The gateway's adaptive policy prices a round by it
(specdec.gateway.round.policy).
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections import deque
from dataclasses import dataclass, replace

from specdec.v1 import common_pb2

# Lower edges of the batch buckets (rows in a forward).
BUCKETS = (1, 2, 4, 8, 16)
MAX_TOKENS = 32  # widest forward (tokens a row) that is fitted
RAGGED_MAX_TOKENS = 256  # widest forward (tokens in all) fitted where a forward has no pads
# Lower edges of the ranges of tokens a ragged forward computes, one measured point each.
RAGGED_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DECAY = 0.98  # weight of the past per fitted forward: about 50 forwards of memory
HUBER = 2.5  # residuals beyond this many mean absolute residuals are weighted down
WINDOW_S = 2.0  # the span of a replica's reported load (`LoadWindow`)


def bucket_of(rows: int) -> int:
    """The index in BUCKETS of a forward of `rows` rows."""
    index = 0
    for i, edge in enumerate(BUCKETS):
        if rows >= edge:
            index = i
    return index


@dataclass(frozen=True, slots=True)
class Line:
    """t(n) = base_ms + per_token_ms · n for n >= 2, and t(1) = step_ms (0: on the line),
    fitted from `samples` forwards (decayed count) over widths up to `widest` tokens, of
    `rows` rows on average (0: not known), `step_samples` of them one-token forwards."""

    base_ms: float
    per_token_ms: float
    samples: float
    widest: int = 1
    step_ms: float = 0.0
    rows: float = 0.0
    step_samples: float = 0.0

    def ms(self, tokens: float) -> float:
        if tokens <= 1 and self.step_ms > 0:
            return self.step_ms
        return self.base_ms + self.per_token_ms * tokens

    def scaled(self, factor: float) -> Line:
        """The same shape, every time times `factor`."""
        return replace(
            self,
            base_ms=self.base_ms * factor,
            per_token_ms=self.per_token_ms * factor,
            step_ms=self.step_ms * factor,
        )

    @property
    def step_share(self) -> float:
        """b / t(1): what one more token costs beyond two, as a share of a one-token step."""
        one = self.ms(1)
        return self.per_token_ms / one if one > 0 else 0.0

    @property
    def first_share(self) -> float:
        """(t(2) - t(1)) / t(1): what verifying a first draft token costs, as a share of a
        one-token step (b / t(1) where the step lies on the line)."""
        one = self.ms(1)
        return (self.ms(2) - one) / one if one > 0 else 0.0

    def formula(self) -> str:
        """'t(n) = a + b·n ms', with the step when it lies off the line."""
        text = f"t(n) = {self.base_ms:.1f} + {self.per_token_ms:.2f}·n ms"
        if self.step_ms > 0:
            text += f" for n >= 2, t(1) = {self.step_ms:.1f} ms"
        return text


class _Fit:
    """Decayed, Huber-weighted least squares of t against n."""

    __slots__ = ("narrowest", "spread", "sw", "sx", "sxx", "sxy", "sy", "widest")

    def __init__(self) -> None:
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.spread: float | None = None  # decayed mean absolute residual, ms
        self.widest = 0
        self.narrowest = 0

    def add(self, n: int, ms: float, decay: float, robust: bool = True) -> None:
        weight = 1.0
        line = self.line(None) if robust else None
        if line is not None:
            residual = abs(ms - line.ms(n))
            if self.spread is not None and self.spread > 0 and residual > HUBER * self.spread:
                weight = HUBER * self.spread / residual
            if self.spread is None:
                self.spread = residual
            else:  # the scale itself is updated with the residual clipped: stalls do not
                # inflate it
                clipped = min(residual, HUBER * self.spread) if self.spread > 0 else residual
                self.spread = decay * self.spread + (1 - decay) * clipped
        for name in ("sw", "sx", "sy", "sxx", "sxy"):
            setattr(self, name, getattr(self, name) * decay)
        self.sw += weight
        self.sx += weight * n
        self.sy += weight * ms
        self.sxx += weight * n * n
        self.sxy += weight * n * ms
        self.widest = max(self.widest, n)
        self.narrowest = n if not self.narrowest else min(self.narrowest, n)

    def mean(self) -> float | None:
        """The weighted mean of t (None before any forward)."""
        return self.sy / self.sw if self.sw > 0 else None

    def line(self, prior: Line | None) -> Line | None:
        """The least-squares line; with one width n0 seen, the prior's line scaled to pass
        through t(n0) (flat without a prior)."""
        if self.sw <= 0:
            return None
        mean_x, mean_y = self.sx / self.sw, self.sy / self.sw
        var_x = self.sxx / self.sw - mean_x * mean_x
        if self.widest > self.narrowest and var_x > 1e-6:
            slope = (self.sxy / self.sw - mean_x * mean_y) / var_x
            slope = max(0.0, slope)
            base = mean_y - slope * mean_x
            if base < 0:  # a line through the origin fits the points better than a < 0
                base, slope = 0.0, self.sxy / self.sxx
            return Line(base, slope, self.sw, self.widest)
        # One width seen: t at that width is measured, the slope is not.
        n0 = round(mean_x)
        wide = Line(prior.base_ms, prior.per_token_ms, 0.0) if prior is not None else None
        if wide is None or wide.ms(n0) <= 0:
            return Line(mean_y, 0.0, self.sw, self.widest)
        scaled = wide.scaled(mean_y / wide.ms(n0))
        return Line(scaled.base_ms, scaled.per_token_ms, self.sw, self.widest)


class _Bucket:
    """One batch bucket's fit: the one-token forwards' mean (the step) and the line through
    the wider ones."""

    __slots__ = ("rows_sum", "rows_weight", "step", "wide")

    def __init__(self) -> None:
        self.step = _Fit()  # forwards of one token: a decayed, Huber-weighted mean
        self.wide = _Fit()  # forwards of 2 tokens or more: the line
        self.rows_sum = self.rows_weight = 0.0  # the forwards' rows, decayed

    def add(self, n: int, ms: float, decay: float, robust: bool = True, rows: int = 1) -> None:
        (self.step if n <= 1 else self.wide).add(n, ms, decay, robust)
        self.rows_sum = self.rows_sum * decay + rows
        self.rows_weight = self.rows_weight * decay + 1.0

    def line(self, prior: Line | None) -> Line | None:
        line = self._line(prior)
        if line is None:
            return None
        rows = self.rows_sum / self.rows_weight if self.rows_weight > 0 else 0.0
        return replace(line, rows=rows, step_samples=self.step.sw)

    def _line(self, prior: Line | None) -> Line | None:
        step = self.step.mean()
        wide = self.wide.line(prior)
        if wide is None:
            if step is None:
                return None
            if prior is None or prior.ms(1) <= 0:  # no shape known: a flat line
                return Line(step, 0.0, self.step.sw, 1, step)
            return replace(prior.scaled(step / prior.ms(1)), samples=self.step.sw, widest=1)
        if step is None:  # the step from the prior's, scaled as the line was
            prior_step = prior.ms(1) if prior is not None else 0.0
            ratio = prior_step / prior.ms(2) if prior is not None and prior.ms(2) > 0 else 0.0
            step = ratio * wide.ms(2) if ratio else 0.0
        return replace(wide, samples=wide.samples + self.step.sw, step_ms=step)


class CostCurve:
    """A replica's forward cost per batch bucket (see the module docstring)."""

    def __init__(self, decay: float = DECAY, max_tokens: int | None = None, ragged: bool = False):
        self.decay = decay
        self.ragged = ragged  # forwards without pads: one line over the tokens computed
        if max_tokens is None:
            max_tokens = RAGGED_MAX_TOKENS if ragged else MAX_TOKENS
        self.max_tokens = max_tokens
        self._fits = [_Bucket() for _ in BUCKETS]
        self.prior: Line | None = None  # the start-up probe's line (rows = 1)
        # ragged: a decayed mean point (tokens, ms) per range of RAGGED_EDGES
        self._points = [_Fit() for _ in RAGGED_EDGES] if ragged else []

    def seed(self, points: list[tuple[int, float]]) -> Line:
        """The start-up probe's forwards (ms by tokens, one row): their line is the prior,
        and a ragged curve's points start from them. Returns the line."""
        self.prior = fit_points(points)
        for n, ms in points:
            self._add_point(n, ms)
        return self.prior

    def _add_point(self, tokens: int, ms: float) -> None:
        if self._points and 1 <= tokens <= self.max_tokens:
            index = bisect.bisect_right(RAGGED_EDGES, tokens) - 1
            self._points[index].add(tokens, ms, self.decay)

    def points(self) -> list[tuple[float, float, float]]:
        """A ragged curve's measured points, (mean tokens, mean ms, forwards), narrowest
        first (empty for a padded curve)."""
        out = []
        for fit in self._points:
            if fit.sw > 0:
                out.append((fit.sx / fit.sw, fit.sy / fit.sw, fit.sw))
        return out

    def add(self, tokens: int, rows: int, seconds: float) -> None:
        """A forward that fed `tokens` tokens a row (the widest row) over `rows` rows; of a
        ragged curve, `tokens` is what the forward computed in all (its rows are not
        fitted: they cost their tokens)."""
        if self.ragged:
            rows = 1
        if tokens < 1 or tokens > self.max_tokens or rows < 1 or not math.isfinite(seconds):
            return
        self._add_point(tokens, seconds * 1e3)
        self._fits[bucket_of(rows)].add(tokens, seconds * 1e3, self.decay, rows=rows)

    def line(self, rows: int = 1) -> Line | None:
        """The fit for forwards of `rows` rows; a bucket with no forwards yet borrows the
        nearest narrower one's (the prior for rows = 1); None before anything is known."""
        index = bucket_of(rows)
        for i in range(index, -1, -1):
            line = self._fits[i].line(self.prior)
            if line is not None:
                return line
        return self.prior

    def buckets(self) -> list[tuple[int, Line]]:
        """The fitted buckets: (lowest rows, line), narrowest first."""
        out = []
        for edge, fit in zip(BUCKETS, self._fits, strict=True):
            line = fit.line(self.prior)
            if line is not None:
                out.append((edge, line))
        if not out and self.prior is not None:
            out.append((1, self.prior))
        return out


def fit_points(points: list[tuple[int, float]]) -> Line:
    """An unweighted fit through (tokens, ms) points (the start-up probe): the mean of the
    one-token points as the step, a least-squares line through the wider ones."""
    bucket = _Bucket()
    for n, ms in points:
        bucket.add(n, ms, 1.0, robust=False)
    line = bucket._line(None)  # a probe's line says nothing of the rows it will be read at
    if line is None:
        raise ValueError("no points to fit")
    return line


@dataclass(frozen=True, slots=True)
class Load:
    """A replica's load as it reports it (common.proto ReplicaLoad)."""

    waiting: int = 0  # model requests queued or running now
    window_s: float = 0.0  # the span of what follows, seconds
    forwards: int = 0
    busy: float = 0.0  # share of the window spent in forwards
    rows_per_forward: float = 0.0  # as its rows saw it (row-weighted)
    tokens_per_forward: float = 0.0  # rows x widest row (ragged: the rows' tokens)
    rows_per_second: float = 0.0

    def to_proto(self) -> common_pb2.ReplicaLoad:
        return common_pb2.ReplicaLoad(
            waiting=self.waiting,
            window_s=self.window_s,
            forwards=self.forwards,
            busy=self.busy,
            rows_per_forward=self.rows_per_forward,
            tokens_per_forward=self.tokens_per_forward,
            rows_per_second=self.rows_per_second,
        )

    @classmethod
    def from_proto(cls, message: common_pb2.ReplicaLoad) -> Load | None:
        """The load, or None where nothing in it is finite and in range (a report that
        says nothing is not a load of 0)."""
        values = (
            message.window_s,
            message.busy,
            message.rows_per_forward,
            message.tokens_per_forward,
            message.rows_per_second,
        )
        if message.window_s <= 0 or not all(math.isfinite(v) and v >= 0 for v in values):
            return None
        return cls(
            waiting=message.waiting,
            window_s=message.window_s,
            forwards=message.forwards,
            busy=min(1.0, message.busy),
            rows_per_forward=message.rows_per_forward,
            tokens_per_forward=message.tokens_per_forward,
            rows_per_second=message.rows_per_second,
        )

    @property
    def forward_s(self) -> float:
        """The mean forward's seconds in the window (0 without one)."""
        return self.busy * self.window_s / self.forwards if self.forwards else 0.0


class LoadWindow:
    """The forwards a replica ran in the last `window` seconds: `add` from the model
    thread after each forward, `load` from any thread (a lock guards the entries). Both
    are O(1) but for the forwards that leave the window: every response carries a load,
    and a window of 2 ms forwards holds a thousand."""

    def __init__(self, window: float = WINDOW_S, since: float = 0.0):
        self.window = window
        self.since = since  # when it started counting (the window before is not known)
        self._lock = threading.Lock()
        # (ended, seconds, rows, tokens): one per forward, oldest first
        self._forwards: deque[tuple[float, float, int, int]] = deque()
        self._seconds = 0.0  # sums over _forwards
        self._rows = 0
        self._rows_squared = 0
        self._tokens = 0

    def add(
        self, ended: float, seconds: float, rows: int, tokens: int, computed: int | None = None
    ) -> None:
        """A forward of `rows` rows, `tokens` tokens its widest, ended at `ended` after
        `seconds` (any clock, the same as `load`'s); `computed`: the tokens it computed
        (default rows x widest: pads included; a ragged forward's own count)."""
        if computed is None:
            computed = rows * tokens
        with self._lock:
            self._forwards.append((ended, seconds, rows, computed))
            self._seconds += seconds
            self._rows += rows
            self._rows_squared += rows * rows
            self._tokens += computed
            self._drop(ended - self.window)

    def _drop(self, start: float) -> None:
        """Forget the forwards that ended by `start` (the lock held)."""
        while self._forwards and self._forwards[0][0] <= start:
            _, seconds, rows, tokens = self._forwards.popleft()
            self._seconds -= seconds
            self._rows -= rows
            self._rows_squared -= rows * rows
            self._tokens -= tokens
        if not self._forwards:
            self._seconds = 0.0  # no drift of the float sum

    def load(self, now: float, waiting: int) -> Load:
        """The load over the window ending `now`, with `waiting` requests now."""
        start = max(now - self.window, self.since)
        span = now - start
        if span <= 0:
            return Load(waiting=waiting)
        with self._lock:
            self._drop(start)
            n, rows, tokens = len(self._forwards), self._rows, self._tokens
            busy = self._seconds
            if n:  # the oldest may have begun before the window
                ended, seconds, _, _ = self._forwards[0]
                busy -= max(0.0, seconds - (ended - start))
            rows_squared = self._rows_squared
        return Load(
            waiting=waiting,
            window_s=span,
            forwards=n,
            busy=min(1.0, max(0.0, busy) / span),
            # the rows of the forward a row was in: forwards of 7 rows and of 1 give 6.25,
            # what 7 of every 8 rows shared (a plain mean would say 4)
            rows_per_forward=rows_squared / rows if rows else 0.0,
            tokens_per_forward=tokens / n if n else 0.0,
            rows_per_second=rows / span,
        )


def to_proto(
    buckets: list[tuple[int, Line]],
    load: Load | None = None,
    ragged: bool = False,
    points: list[tuple[float, float, float]] | None = None,
) -> common_pb2.ForwardCost:
    """The fitted buckets (`CostCurve.buckets`) and the load, as the ForwardCost a replica
    reports; `ragged`: its forwards have no pads (the buckets are one line over a forward's
    tokens), and `points` its measured surface (`CostCurve.points`)."""
    return common_pb2.ForwardCost(
        ragged=ragged,
        points=[
            common_pb2.ForwardCost.Point(tokens=n, ms=ms, samples=w) for n, ms, w in points or ()
        ],
        buckets=[
            common_pb2.ForwardCost.Bucket(
                rows=rows,
                base_ms=line.base_ms,
                per_token_ms=line.per_token_ms,
                samples=line.samples,
                widest=line.widest,
                step_ms=line.step_ms,
                rows_mean=line.rows,
                step_samples=line.step_samples,
            )
            for rows, line in buckets
        ],
        load=load.to_proto() if load is not None else None,
    )


@dataclass(frozen=True, slots=True)
class ReportedCost:
    """A replica's reported curve, read on the gateway: the line for a forward of `rows`
    rows is the widest bucket at or below it; `ms` reads the surface between buckets.
    `load`: what it reported with it (None: nothing, an older replica). `ragged`: the
    replica's forwards have no pads, and its line is over the tokens a forward computes."""

    buckets: tuple[tuple[int, Line], ...]
    load: Load | None = None
    ragged: bool = False
    points: tuple[tuple[float, float], ...] = ()  # ragged: (tokens, ms), ms non-decreasing

    @classmethod
    def from_proto(cls, message: common_pb2.ForwardCost) -> ReportedCost | None:
        rows = tuple(
            (
                b.rows,
                Line(
                    b.base_ms,
                    b.per_token_ms,
                    b.samples,
                    b.widest,
                    b.step_ms,
                    b.rows_mean if math.isfinite(b.rows_mean) and b.rows_mean > 0 else 0.0,
                    b.step_samples if math.isfinite(b.step_samples) else 0.0,
                ),
            )
            for b in sorted(message.buckets, key=lambda b: b.rows)
            if b.rows >= 1
            and math.isfinite(b.base_ms)
            and math.isfinite(b.per_token_ms)
            and math.isfinite(b.step_ms)
        )
        load = Load.from_proto(message.load) if message.HasField("load") else None
        points: list[tuple[float, float]] = []
        for p in sorted(message.points, key=lambda p: p.tokens):
            if math.isfinite(p.tokens) and p.tokens >= 1 and math.isfinite(p.ms) and p.ms > 0:
                points.append((p.tokens, max(p.ms, points[-1][1] if points else 0.0)))
        return cls(rows, load, message.ragged, tuple(points)) if rows else None

    def line(self, rows: int = 1) -> Line:
        chosen = self.buckets[0][1]
        for edge, line in self.buckets:
            if rows >= edge:
                chosen = line
        return chosen

    def ms(self, rows: float, tokens: float) -> float:
        """t(rows, tokens a row) on the surface: each bucket's line read at the mean rows
        of its forwards, linear in rows between the two buckets around `rows` (the nearest
        one's alone outside them). A bucket that reports no mean rows (an older replica)
        is its `line` alone. Ragged: the line at the tokens the forward computes, this
        row's and the other rows' (each the tokens a row computed in the reported load,
        else one)."""
        if self.ragged:
            return self.ragged_ms(tokens + max(0.0, rows - 1.0) * self.row_tokens)
        placed = [(line.rows, line) for _, line in self.buckets if line.rows > 0]
        if len(placed) < 2:
            return self._bucket_ms(self.line(max(1, round(rows))), tokens)
        placed.sort(key=lambda p: p[0])
        if rows <= placed[0][0]:
            return self._bucket_ms(placed[0][1], tokens)
        for (lo_rows, lo), (hi_rows, hi) in itertools.pairwise(placed):
            if rows <= hi_rows:
                share = (rows - lo_rows) / (hi_rows - lo_rows) if hi_rows > lo_rows else 1.0
                low, high = self._bucket_ms(lo, tokens), self._bucket_ms(hi, tokens)
                return low + share * (high - low)
        return self._bucket_ms(placed[-1][1], tokens)

    def batch_ms(self, rows: float, tokens: float) -> float:
        """A forward of `rows` rows of `tokens` tokens each: on the surface (`ms`) for a
        padded replica, at the tokens they compute for a ragged one."""
        return self.ragged_ms(rows * tokens) if self.ragged else self.ms(rows, tokens)

    def ragged_ms(self, computed: float) -> float:
        """A ragged forward's ms at the tokens it computes: between the measured points,
        linear; beyond the widest, its cost a token; without points, the line."""
        points = self.points
        if not points:
            return self.line(1).ms(computed)
        if computed <= points[0][0]:
            return points[0][1]
        for (n0, ms0), (n1, ms1) in itertools.pairwise(points):
            if computed <= n1:
                return ms0 + (ms1 - ms0) * (computed - n0) / (n1 - n0) if n1 > n0 else ms1
        n, ms = points[-1]
        return ms * computed / n

    @property
    def row_tokens(self) -> float:
        """Tokens a row computed in the forwards of the reported load (1 without one)."""
        load = self.load
        if load is None or load.forwards <= 0 or load.rows_per_forward <= 0:
            return 1.0
        return max(1.0, load.tokens_per_forward / load.rows_per_forward)

    def _bucket_ms(self, line: Line, tokens: float) -> float:
        """A bucket's t(n). What a bucket of R > 1 rows has not measured is read off the
        one-row line at the tokens the forward computes (R n): its step where it ran no
        one-token forward (never above its own t(2) when that was measured), its wider
        forwards where it ran none (scaled by its measured step over that estimate)."""
        one = self.buckets[0][1]
        if line.rows < 1.5 or self.buckets[0][0] != 1 or one is line or one.rows <= 0:
            return line.ms(tokens)
        step_seen = line.step_samples > 0.5
        wide_seen = line.samples - line.step_samples > 0.5
        if tokens <= 1:
            if step_seen:
                return line.ms(1)
            estimate = one.ms(line.rows)
            return min(estimate, line.ms(2)) if wide_seen else estimate
        if wide_seen:
            return line.ms(tokens)
        estimate = one.ms(line.rows * tokens)
        if step_seen and one.ms(line.rows) > 0:
            estimate *= line.ms(1) / one.ms(line.rows)
        return estimate
