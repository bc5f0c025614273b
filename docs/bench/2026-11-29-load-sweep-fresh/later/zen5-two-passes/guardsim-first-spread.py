"""The guard's exploration while a mode has one epoch at a level, simulated (the table in
guardsim-first-spread.md). Run from the repository at 33d5edc:

    .venv/bin/python docs/bench/2026-11-29-load-sweep-fresh/later/zen5-two-passes/guardsim-first-spread.py
"""

from specdec.gateway.round.policy.guard import GuardParams
from specdec.tools.bench import guardsim

gaps = (-0.10, -0.05, 0.0, 0.05, 0.10, 0.15, 0.25, 0.45)
variants = {
    "a mode measured once: explore after 4 (before)": GuardParams(first_spread=100.0),
    "its gap less 0.10 of spread (now)": GuardParams(),
    "its gap less 0.05 of spread": GuardParams(first_spread=0.05),
}
for sd in (0.06, 0.10):
    for epochs in (12, 36, 120):
        print(f"**{epochs} epochs**, 300 runs, noise {sd:.0%}\n")
        print(
            guardsim.table(guardsim.compare(variants, epochs, 300, gaps=gaps, sd=sd), gaps) + "\n"
        )
