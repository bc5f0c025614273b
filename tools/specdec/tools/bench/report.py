"""The bench's outputs: the markdown table, the speedup chart, and the report from JSON."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.common.cost import Line
from specdec.tools.bench.hf import NEAR_TIE_ULPS, near_ties_only
from specdec.tools.bench.modes import DEFAULT_DRAFTER, STEP_TARGET


def markdown(
    rows: dict[str, dict], cost_ratio: float | None, drafters: dict[str, dict] | None = None
) -> str:
    head = (
        "| mode | tok/s | TTFT ms | speedup vs target | vs k=0 | accept | c | tokens/round "
        "| accepted per position | bound | SSD hits | identical |\n"
        "|---|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|---|\n"
    )
    lines = []
    for name, r in rows.items():
        if not r["contender"]:
            continue

        def f(key, fmt="{:.2f}", row=r):
            v = row.get(key)
            return "" if v is None else fmt.format(v)

        lines.append(
            f"| {name} | {r['tokens_per_second']:.2f} | {r['ttft_ms']:.0f} | "
            f"{r['speedup_vs_target']:.2f}x | {f('speedup_vs_k0', '{:.2f}x')} | "
            f"{f('acceptance_rate', '{:.0%}')} | {f('cost_ratio', '{:.3f}')} | "
            f"{f('mean_accepted_length')} | "
            f"{' '.join(map(str, r.get('accepted_per_position', [])))} | "
            f"{f('bound_speedup', '{:.2f}x')} | {f('ssd_hit_rate', '{:.0%}')} | "
            f"{_identical(r)} |"
        )
    tail = ""
    if cost_ratio is not None:
        d = rows["draft"]
        tail = (
            f"\nCost ratio c = {cost_ratio:.3f} (draft alone {d['tokens_per_second']:.2f} tok/s "
            f"vs target alone {rows['target']['tokens_per_second']:.2f} tok/s). "
            "bound = tokens per round / (c k + 1).\n"
        )
    tail += fastest_target(rows) + feature_bytes(rows)
    return head + "\n".join(lines) + "\n" + tail + drafter_table(drafters) + tracing_overhead(rows)


def feature_bytes(rows: dict[str, dict]) -> str:
    """The target's features a head drafter's rows moved per round (verifier to drafter)."""
    heads = {
        n: r["feature_bytes_per_round"] for n, r in rows.items() if "feature_bytes_per_round" in r
    }
    if not heads:
        return ""
    listed = ", ".join(f"{n} {b / 1024:.1f} KiB" for n, b in heads.items())
    return f"\nThe target's features per round (verifier to head drafter): {listed}.\n"


def fastest_target(rows: dict[str, dict]) -> str:
    """With the target alone also measured in its fastest one-token layout: how fast, and
    the best stack row against the fastest target alone."""
    step = next((n for n in rows if n.startswith(STEP_TARGET)), None)
    if step is None or "target" not in rows:
        return ""
    stack = [(r["speedup_vs_fastest_target"], n) for n, r in rows.items() if r["engine"] == "stack"]
    best = max(stack, default=None)
    ratio = rows[step]["tokens_per_second"] / rows["target"]["tokens_per_second"]
    text = (
        f"\nThe target alone in `{step}` ran {rows[step]['tokens_per_second']:.2f} tok/s, "
        f"{ratio:.2f}x the target alone in the stack's layout."
    )
    if best is not None:
        text += (
            f" Against the faster of the two, the fastest stack row ({best[1]}) is {best[0]:.2f}x."
        )
    return text + "\n"


AS_LOADED = "(the stack's --dtype)"  # a variant with no flags of its own


def drafter_table(drafters: dict[str, dict] | None) -> str:
    """Per drafter variant (--drafters): its flags and its cost ratio c, from its drafter
    alone through the service against the target alone interleaved with it."""
    if not drafters:
        return ""
    lines = [
        f"| {name} | {' '.join(d['flags']) or AS_LOADED} | {d['cost_ratio']:.3f} | "
        f"{d['draft_tokens_per_second']:.2f} | {d['target_tokens_per_second']:.2f} |"
        for name, d in drafters.items()
    ]
    return (
        "\nDrafter variants: c = time per token of the drafter alone (one greedy Draft of the "
        "whole length through its service, on the drafter's CPU) / the target alone's; the "
        "c column above and each row's bound use its variant's c.\n\n"
        "| drafter | flags | c | drafter alone tok/s | target alone tok/s |\n"
        "|---|---|--:|--:|--:|\n" + "\n".join(lines) + "\n"
    )


def tracing_overhead(rows: dict[str, dict]) -> str:
    """The slowdown of each traced mode against its untraced twin (--tracing)."""
    traced = [(n, r) for n, r in rows.items() if r.get("traced")]
    if not traced:
        return ""
    parts = [f"{n.removesuffix(' traced')} {r['tracing_slowdown']:+.1%}" for n, r in traced]
    overall = sum(r["seconds"] for _, r in traced) / sum(r["untraced_seconds"] for _, r in traced)
    return (
        "\nTracing overhead (sampling 1.0, every span exported over OTLP/gRPC to a receiver "
        f"on loopback; slowdown in tokens/s against the same mode untraced): {', '.join(parts)}; "
        f"all traced modes together {overall - 1:+.1%}.\n"
    )


def _identical(row: dict) -> str:
    if row["exact"]:
        return "yes"
    if near_ties_only(row):
        return f"near-tie in prompts {row['mismatched_prompts']}"
    return f"NO {row['mismatched_prompts']}"


def chart(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rows = {n: r for n, r in rows.items() if not r.get("traced")}  # same speed, same k
    stack = [r for r in rows.values() if r["engine"] == "stack"]
    drafters = list(dict.fromkeys(r.get("drafter", DEFAULT_DRAFTER) for r in stack))
    ks: set[int] = set()
    for i, drafter in enumerate(drafters):
        mine = [r for r in stack if r.get("drafter", DEFAULT_DRAFTER) == drafter]
        label = "" if len(drafters) == 1 else f" [{drafter}]"
        spec = sorted(
            ((r["k"], r["speedup_vs_target"], r) for r in mine if not r["ssd"]),
            key=lambda t: t[:2],  # rows of one k and speedup (a tree and its chain) tie
        )
        ks |= {k for k, _, _ in spec}
        color = "C0" if i == 0 else f"C{i + 3}"
        if spec:
            ax.plot(
                [k for k, _, _ in spec],
                [s for _, s, _ in spec],
                "o-",
                color=color,
                label=f"speculative (stack){label}",
            )
        bound = [(k, r["bound_speedup"]) for k, _, r in spec if "bound_speedup" in r]
        if bound:
            ax.plot(*zip(*bound, strict=True), "x--", color=color, alpha=0.5,
                    label=f"bound E/(ck+1){label}")  # fmt: skip
        ssd = sorted((r["k"], r["speedup_vs_target"]) for r in mine if r["ssd"])
        if ssd:
            ks |= {k for k, _ in ssd}
            marker_color = "C3" if i == 0 else color
            ax.plot(*zip(*ssd, strict=True), "s", color=marker_color, label=f"SSD (stack){label}")
    ax.axhline(1.0, color="black", lw=0.8, label="target alone")
    ax.axhline(rows["assisted"]["speedup_vs_target"], color="C2", ls=":", label="HF assisted")
    ax.set_xticks(sorted(ks))
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over target alone (tokens/s)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(out: Path) -> int:
    """Render results.md and speedup.png from out/results.json and print the table;
    exit status 1 if a mode differs from the baseline other than at near-ties."""
    result = json.loads((out / "results.json").read_text())
    rows, meta = result["modes"], result["meta"]
    table = machine_header(meta) + markdown(rows, meta["cost_ratio"], meta.get("drafters"))
    table += peers_table(result.get("peers"), rows)
    (out / "results.md").write_text(table)
    chart(rows, out / "speedup.png")
    print("\n" + table)
    print(f"wrote {out}/results.md and speedup.png from results.json")
    differ = [n for n, r in rows.items() if r["contender"] and not r["exact"]]
    ties = [n for n in differ if near_ties_only(rows[n])]
    if ties:
        print(
            f"{', '.join(ties)}: differ from the target alone only where the two tokens' "
            f"logits are within {NEAR_TIE_ULPS} units in the last place of {meta['dtype']} "
            "(see tie_breaks in results.json)"
        )
    wrong = [n for n in differ if n not in ties]
    if wrong:
        print(f"NOT IDENTICAL to the target alone: {', '.join(wrong)} (see mismatched_prompts)")
        return 1
    return 0


def peers_table(peers: dict | None, rows: dict[str, dict]) -> str:
    """What a user would run instead (--peers), in the same run: each peer mode's tokens/s
    over the prompts, against the peer's own target alone and against ours; peers that
    could not run, with the reason. peers: {"threads": int, "by_peer": {name: {"modes":
    {mode: row}} or {"skipped": reason}}}."""
    if not peers:
        return ""
    ours = rows["target"]["tokens_per_second"]
    best = max(
        (r["tokens_per_second"], name)
        for name, r in rows.items()
        if r["contender"] and r.get("engine") == "stack"
    )
    lines, skipped = [], []
    for peer, entry in peers["by_peer"].items():
        if "skipped" in entry:
            skipped.append(f"- {peer}: {entry['skipped']}")
            continue
        alone = entry["modes"].get("target", {}).get("tokens_per_second")
        for mode, m in entry["modes"].items():
            if "error" in m:
                skipped.append(f"- {peer} {mode}: {m['error'].splitlines()[0]}")
                continue
            tps = m["tokens_per_second"]
            vs_own = f"{tps / alone:.2f}x" if alone else ""
            accept = f"{m['acceptance']:.0%}" if m.get("acceptance") is not None else ""
            lines.append(
                f"| {peer} {mode} | {tps:.2f} | {vs_own} | {tps / ours:.2f}x | "
                f"{best[0] / tps:.2f}x | {accept} |"
            )
    head = (
        f"\nPeers on the same machine: each in its own virtualenv, {peers['threads']} threads "
        "(the stack's CPUs), greedy, the same prompts and length; llama.cpp runs the Q4_K_M "
        f"GGUF files the pair was converted from. The stack's fastest row: {best[1]} at "
        f"{best[0]:.2f} tok/s.\n\n"
        "| peer mode | tok/s | vs its target alone | vs our target alone | our fastest vs it "
        "| accept |\n|---|--:|--:|--:|--:|--:|\n"
    )
    return head + "\n".join(lines) + "\n" + ("\n".join(skipped) + "\n" if skipped else "")


def machine_header(meta: dict) -> str:
    """The machine and each replica's measured forward cost, above the table (runs that
    recorded them)."""
    lines = []
    describe = meta.get("machine", {}).get("describe")
    if describe:
        lines.append(f"Machine: {describe}; dtype {meta.get('dtype')}.")
    for variant, roles in (meta.get("cost_curves") or {}).items():
        for role, c in roles.items():
            if c.get("base_ms") is None:
                continue
            line = Line(c["base_ms"], c["per_token_ms"], 0.0, step_ms=c.get("step_ms") or 0.0)
            one = line.ms(1)
            lines.append(
                f"Forward cost [{variant}] {role} ({c['dtype']}): {line.formula()} (2 tokens: "
                f"{line.ms(2) / one:.2f} steps, 4 tokens: {line.ms(4) / one:.2f}, 9 tokens: "
                f"{line.ms(9) / one:.2f})."
            )
    return "\n\n".join(lines) + "\n\n" if lines else ""
