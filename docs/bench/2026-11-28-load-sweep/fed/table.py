"""Print the load sweep's table (k0, k2, k4 and the default per stack and level) from a run folder."""

import glob
import json
import os
import sys


def throughput(result: dict) -> float:
    return result["output_throughput"]


def main(folder: str) -> None:
    rows: dict = {}
    for path in sorted(glob.glob(folder + "/*/loadtest.json")):
        stack = os.path.basename(os.path.dirname(path)).rsplit("-", 1)[0]
        with open(path) as fh:
            for r in json.load(fh)["results"]:
                rows.setdefault((stack, r["concurrency"]), {})[r["mode"]] = r
    print(
        "| stack | sessions | k0 | k2 | k4 | default (mean draft tokens) | default over k0 "
        "| default over best fixed k | TPOT p50 default / k0 (ms) | p99 default / k0 (ms) |"
    )
    print("|---|--:|--:|--:|--:|--|--:|--:|--|--|")
    for (stack, c), modes in sorted(rows.items()):
        k0, d = modes.get("k0"), modes.get("default")
        if not (k0 and d):
            continue
        fixed = {k: throughput(modes[k]) for k in ("k0", "k2", "k4") if k in modes}
        best = max(fixed, key=fixed.__getitem__)
        cells = [f"{fixed[k]:.2f}" if k in fixed else "" for k in ("k0", "k2", "k4")]
        vs = f"{throughput(d) / fixed[best]:.2f}x ({best})" if len(fixed) > 1 else ""
        print(
            f"| {stack} | {c} | {' | '.join(cells)} | {throughput(d):.2f} ({d['mean_k']:.2f}) "
            f"| **{throughput(d) / throughput(k0):.2f}x** | {vs} "
            f"| {d['median_tpot_ms']:.0f} / {k0['median_tpot_ms']:.0f} "
            f"| {d['p99_tpot_ms']:.0f} / {k0['p99_tpot_ms']:.0f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1])
