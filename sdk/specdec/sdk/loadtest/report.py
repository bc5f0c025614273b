"""The load test's output: markdown tables, ``loadtest.json`` and ``loadtest.png``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specdec.sdk.loadtest.summary import LATENCIES

JSON_NAME = "loadtest.json"
PNG_NAME = "loadtest.png"
_LATENCY_TITLES = {
    "ttft": "TTFT",
    "tpot": "TPOT",
    "itl": "ITL",
    "e2el": "E2E latency",
}


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{code} {n}" for code, n in errors.items()) or "-"


def tables(results: Sequence[dict[str, Any]]) -> str:
    """Throughput and speculation per level and mode, then latency percentiles (ms)."""
    exact = any("exact_checked" in r for r in results)
    head = [
        "level",
        "mode",
        "completed",
        "failed",
        "req/s",
        "output tok/s",
        "steady tok/s",
        "acceptance",
        "tokens/round",
        "SSD hit rate",
        "errors",
    ]
    if exact:
        head.append("exact diffs")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        row = [
            r["level"],
            r["mode"],
            str(r["completed"]),
            str(r["failed"]),
            f"{r['request_throughput']:.2f}",
            f"{r['output_throughput']:.1f}",
            f"{r['steady_output_throughput']:.1f}" if "steady_output_throughput" in r else "-",
            f"{r['acceptance_rate']:.2f}" if r["k"] != 0 else "-",
            f"{r['tokens_per_round']:.2f}",
            f"{r['ssd_hit_rate']:.2f}" if r["ssd"] else "-",
            _errors(r["errors"]),
        ]
        if exact:
            row.append(f"{r['exact_mismatches']}/{r['exact_checked']}")
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "| level | mode | latency (ms) | mean | p50 | p90 | p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name in LATENCIES:
            values = [r[f"{stat}_{name}_ms"] for stat in ("mean", "median", "p90", "p99")]
            cells = " | ".join(f"{v:.1f}" for v in values)
            lines.append(f"| {r['level']} | {r['mode']} | {_LATENCY_TITLES[name]} | {cells} |")
    return "\n".join(lines)


def write_json(out: Path, document: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / JSON_NAME
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


class NoMatplotlib(RuntimeError):
    """The PNG needs matplotlib, an optional extra of the SDK."""


def write_png(out: Path, results: Sequence[dict[str, Any]], by_rate: bool) -> Path:
    """Output throughput against the load level, and p50/p90/p99 end-to-end latency and
    TTFT against it, one line per mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise NoMatplotlib(
            "the PNG chart needs matplotlib, which is not installed: "
            "pip install 'specdec-sdk[loadtest]' (the JSON and the tables are written anyway)"
        ) from None
    modes = list(dict.fromkeys(r["mode"] for r in results))
    xlabel = "request rate (requests/s)" if by_rate else "concurrency"
    key = "request_rate" if by_rate else "concurrency"

    def x_of(r: dict[str, Any]) -> float:
        return float(r[key])

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {"median": "-", "p90": "--", "p99": ":"}
    for mode in modes:
        rows = sorted((r for r in results if r["mode"] == mode), key=x_of)
        xs = [x_of(r) for r in rows]
        line = axes[0].plot(xs, [r["output_throughput"] for r in rows], marker="o", label=mode)
        color = line[0].get_color()
        for ax, name in ((axes[1], "e2el"), (axes[2], "ttft")):
            for stat, style in styles.items():
                ax.plot(
                    xs,
                    [r[f"{stat}_{name}_ms"] for r in rows],
                    style,
                    marker="o",
                    color=color,
                    label=f"{mode} {'p50' if stat == 'median' else stat}",
                )
    axes[0].set_title("output throughput")
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_title("end-to-end latency")
    axes[2].set_title("time to first token")
    for ax in axes[1:]:
        ax.set_ylabel("ms")
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if not by_rate:
            ax.set_xscale("log", base=2)
        levels = sorted({x_of(r) for r in results})
        ax.set_xticks(levels, [f"{v:g}" for v in levels])
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / PNG_NAME
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
