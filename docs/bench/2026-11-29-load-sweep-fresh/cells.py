"""Print each cell of the given loadtest folders: whole and steady output throughput, each
over k0's at the same level, the mean draft tokens and time per output token."""

import json
import sys


def main(folders: list[str]) -> None:
    for folder in folders:
        with open(folder + "/loadtest.json") as fh:
            results = json.load(fh)["results"]
        k0 = {r["concurrency"]: r for r in results if r["mode"] == "k0"}
        for r in results:
            base = k0[r["concurrency"]]
            whole = r["output_throughput"]
            line = f"{folder} c={r['concurrency']} {r['mode']}: whole {whole:.2f} "
            line += f"({whole / base['output_throughput']:.2f}x)"
            steady = r.get("steady_output_throughput")
            if steady is not None:
                line += f" steady {steady:.2f} ({steady / base['steady_output_throughput']:.2f}x)"
                line += f" over {r['steady_duration']:.0f} of {r['duration']:.0f} s"
            line += f" k={r['mean_k']:.2f} tpot p50 {r['median_tpot_ms']:.0f}"
            print(line + f" p99 {r['p99_tpot_ms']:.0f}")


if __name__ == "__main__":
    main(sys.argv[1:])
