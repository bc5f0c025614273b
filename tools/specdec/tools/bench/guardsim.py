"""The goodput guard's choice of mode, simulated over noisy epochs.

    python -m specdec.tools.bench.guardsim [--epochs 12,36,120] [--runs 300] [--sd 0.06]

The guard (specdec.gateway.round.policy.guard) decides each epoch's mode from the rates
its earlier epochs measured (`GoodputGuard._next`). This drives that decision alone, with
the measurements drawn at random instead of run: each mode has a true rate (plain steps
1.0, speculation 1 - gap), and an epoch of a mode measures its true rate times a
log-normal noise of `sd`, one epoch in ten (`outliers`) times 0.70 to 0.85 more (an epoch
that caught a burst of prompts, or the machine's other work). The noise follows the
epochs measured through the stack at 2 to 8 sessions on a 2-vCPU CPU: one mode's epochs
spread 5 to 10%, and now and then one falls a fifth below the rest (at 8 sessions on
torch, plain epochs of 36.8, 35.9, 36.8, 26.8 and 33.0 tokens a second:
docs/bench/2026-11-29-load-sweep-fresh). The first epoch speculates, as the guard's does.

A run's score is the mean true rate of the modes its epochs ran over the faster mode's
rate (1.0: it ran the faster mode throughout), averaged over `runs` runs of `epochs`
epochs. With epochs of 8 to 10 s a cell of 100 s is about 12 epochs, 5 minutes about 36,
20 minutes 120. `compare` scores guard parameters side by side over gaps from speculation
10% faster to 15% slower; the default GuardParams were chosen with it (and
tests/unit/test_guardsim.py holds them to at least the parameters they replaced).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections import deque
from collections.abc import Sequence

from specdec.gateway.round.policy.guard import GoodputGuard, GuardMode, GuardParams

GAPS = (-0.10, -0.05, 0.0, 0.05, 0.10, 0.15)  # speculation's rate below plain steps'
LEVEL = 8
EPOCH_S = 10.0
# What the guard ran before its window grew, its median and its spread's weight halved.
BEFORE = GuardParams(window=4, summary="pooled", z=1.0)


def simulate(
    params: GuardParams,
    gap: float,
    epochs: int,
    rng: random.Random,
    sd: float = 0.06,
    outliers: float = 0.1,
) -> float:
    """One run of `epochs` epochs at one level: the mean true rate of the modes run over
    the faster mode's."""
    guard = GoodputGuard(params, clock=lambda: 0.0)
    true = {GuardMode.PLAIN: 1.0, GuardMode.SPEC: 1.0 - gap}
    mode, got = GuardMode.SPEC, 0.0
    for _ in range(epochs):
        got += true[mode]
        rate = true[mode] * rng.lognormvariate(0.0, sd)
        if rng.random() < outliers:
            rate *= rng.uniform(0.70, 0.85)
        seen = guard.measured.setdefault((LEVEL, mode), deque(maxlen=params.window))
        seen.append((rate * EPOCH_S, EPOCH_S))
        mode = guard._next(LEVEL)
    return got / epochs / max(true.values())


def score(
    params: GuardParams,
    gap: float,
    epochs: int,
    runs: int,
    seed: int = 1,
    sd: float = 0.06,
    outliers: float = 0.1,
) -> float:
    """The mean of `runs` runs' scores (`simulate`), reproducible by `seed`."""
    rng = random.Random(seed)
    return statistics.fmean(simulate(params, gap, epochs, rng, sd, outliers) for _ in range(runs))


def compare(
    variants: dict[str, GuardParams],
    epochs: int,
    runs: int,
    gaps: Sequence[float] = GAPS,
    sd: float = 0.06,
    seed: int = 1,
) -> dict[str, list[float]]:
    """Each variant's score at each gap (the same seeds for every variant)."""
    return {
        name: [score(params, gap, epochs, runs, seed, sd) for gap in gaps]
        for name, params in variants.items()
    }


def table(scores: dict[str, list[float]], gaps: Sequence[float] = GAPS) -> str:
    head = " | ".join(f"{g:+.0%}" for g in gaps)
    lines = [f"| guard | {head} | mean | lowest |", "|---" + "|--:" * (len(gaps) + 2) + "|"]
    for name, cells in scores.items():
        body = " | ".join(f"{c:.3f}" for c in cells)
        lines.append(f"| {name} | {body} | {statistics.fmean(cells):.3f} | {min(cells):.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.tools.bench.guardsim")
    parser.add_argument("--epochs", default="12,36,120", help="run lengths, comma-separated")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--sd", type=float, default=0.06, help="an epoch's log-normal noise")
    args = parser.parse_args(argv)
    variants = {
        "before (window 4, pooled, z 1)": BEFORE,
        "window 8, pooled, z 1": GuardParams(summary="pooled", z=1.0),
        "window 8, median, z 1": GuardParams(z=1.0),
        "default (window 8, median, z 0.5)": GuardParams(),
    }
    print("Score: the faster mode's share of the epochs' rate (1.0 = always the faster);")
    print("columns: speculation's rate below plain steps'.\n")
    for epochs in (int(e) for e in args.epochs.split(",")):
        print(f"**{epochs} epochs**, {args.runs} runs, noise {args.sd:.0%}\n")
        print(table(compare(variants, epochs, args.runs, sd=args.sd)) + "\n")


if __name__ == "__main__":
    main()
