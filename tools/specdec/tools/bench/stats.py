"""Per-mode statistics of a bench run: throughput, acceptance, exactness, the bound."""

from __future__ import annotations

from specdec.tools.bench.modes import ModeRun, Sample


def cost_ratios(runs: dict[str, ModeRun]) -> dict[str, float]:
    """Per drafter variant: c = the variant's time per token drafting alone through its
    drafter service (`draft [name]`) / the target's alone (that variant's baseline)."""
    return {
        run.mode.drafter: mode_tps(runs[run.mode.baseline]) / mode_tps(run)
        for run in runs.values()
        if run.mode.engine == "drafter"
    }


def summarize(runs: dict[str, ModeRun], cost_ratio: dict[str, float] | None) -> dict[str, dict]:
    """Per mode: throughput, TTFT, acceptance, exactness, speedups, and the bound.

    Each mode is compared with its own baseline (the target alone, interleaved with it on
    the same drafter variant's stack); cost_ratio: c per drafter variant (cost_ratios)."""
    k0 = runs.get("k=0")
    # The fastest target alone: the stack's layout, or the fastest one-token step's.
    targets = [
        r for r in runs.values() if r.mode.engine == "hf" and r.mode.name.startswith("target")
    ]
    fastest = max((mode_tps(r) for r in targets), default=None)
    out = {}
    for name, run in runs.items():
        base = runs[run.mode.baseline]
        tps = mode_tps(run)
        same_run = k0 is not None and k0.mode.baseline == run.mode.baseline
        row: dict = {
            "engine": run.mode.engine,
            "k": run.mode.k,
            "ssd": run.mode.ssd,
            "k_policy": run.mode.k_policy,
            "contender": run.mode.contender,
            "traced": run.mode.traced,
            "drafter": run.mode.drafter,
            "baseline": run.mode.baseline,
            "tokens": sum(len(s.tokens) for s in run.samples),
            "seconds": round(sum(s.seconds for s in run.samples), 3),
            "tokens_per_second": round(tps, 3),
            "ttft_ms": round(sum(s.ttft_ms for s in run.samples) / len(run.samples), 1),
            "speedup_vs_target": round(tps / mode_tps(base), 3),
            "speedup_vs_k0": round(tps / mode_tps(k0), 3) if k0 is not None and same_run else None,
            "speedup_vs_fastest_target": round(tps / fastest, 3) if fastest else None,
        }
        c = (cost_ratio or {}).get(run.mode.drafter)
        if run.mode.engine == "drafter" and c is not None:
            row["cost_ratio"] = round(c, 4)
        row["per_prompt"] = [
            {
                "tokens": len(s.tokens),
                "tokens_per_second": round(len(s.tokens) / s.seconds, 3),
                "ttft_ms": round(s.ttft_ms, 1),
                "first_difference": first_difference(s.tokens, b.tokens),
                **({"stats": s.stats} if s.stats else {}),
            }
            for s, b in zip(run.samples, base.samples, strict=True)
        ]
        if run.mode.contender:  # the draft alone is not meant to match
            differ = [
                i
                for i, (s, b) in enumerate(zip(run.samples, base.samples, strict=True))
                if s.tokens != b.tokens
            ]
            row |= {"exact": not differ, "mismatched_prompts": differ}
        if run.mode.engine == "stack" and run.mode.k:
            stats = [_stats(s) for s in run.samples]
            rounds = sum(s["rounds"] for s in stats)
            drafted = sum(s["draft_tokens"] for s in stats)
            accepted = sum(s["accepted_tokens"] for s in stats)
            # A lookup draft may be longer than k (it is bounded by the replicas' largest).
            per_pos = [0] * max([run.mode.k, *(len(s["accepted_per_position"]) for s in stats)])
            for s in stats:
                for i, a in enumerate(s["accepted_per_position"]):
                    per_pos[i] += a
            mean_len = (accepted + rounds) / rounds if rounds else 0.0
            row |= {
                "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                "mean_accepted_length": round(mean_len, 3),
                "accepted_per_position": per_pos,
                "rounds": rounds,
                "cache_misses": sum(s["cache_misses"] for s in stats),
            }
            if run.mode.method != "model":
                row["method"] = run.mode.method
                row["by_source"] = _by_source(stats)
            elif c is not None:
                # Leviathan et al.: speedup <= E / (c k + 1) with E = (1 - a^(k+1)) / (1 - a)
                # the expected tokens per round; E is measured here, so is c (this
                # drafter variant's).
                row["cost_ratio"] = round(c, 4)
                # An adaptive row's k is a bound: its rounds drafted mean_k on average.
                k = run.mode.k if run.mode.k_policy == "fixed" else drafted / max(1, rounds)
                if k > 0:
                    row["acceptance_alpha"] = round(_alpha(mean_len, k), 4)
                row["bound_speedup"] = round(mean_len / (c * k + 1), 3)
            # Where a round's time goes, per round (gateway's view).
            row["round_ms"] = round(row["seconds"] * 1e3 / rounds, 1)
            row["drafter_wait_ms_per_round"] = round(_total(stats, "drafter_wait_ms") / rounds, 1)
            features = sum(s.get("feature_bytes", 0) for s in stats)  # a head drafter's
            if features:
                row["feature_bytes_per_round"] = round(features / rounds)
            if run.mode.ssd:
                hits, misses = _total(stats, "ssd_hits"), _total(stats, "ssd_misses")
                speculated = hits + misses
                sent = _total(stats, "ssd_speculates")
                row |= {
                    "ssd_hit_rate": round(hits / speculated, 4) if speculated else 0.0,
                    # Speculates still running at the verdict: their branches are not
                    # counted in ssd_branches_per_round (the gateway never sees them).
                    "ssd_late_rate": round(_total(stats, "ssd_late") / sent, 4) if sent else 0.0,
                    "ssd_branches_per_round": round(_total(stats, "ssd_branches") / rounds, 2),
                    "ssd_hidden_ms_per_round": round(_total(stats, "ssd_hidden_ms") / rounds, 1),
                    "ssd_bytes_per_round": round(_total(stats, "ssd_bytes") / rounds),
                }
        out[name] = row
    return out


def _stats(sample: Sample) -> dict:
    """A stack sample's speculation stats (the response's; a stack run records them)."""
    if sample.stats is None:
        raise ValueError("a stack mode's sample carries no speculation stats")
    return sample.stats


def _by_source(stats: list[dict]) -> dict[str, dict[str, int]]:
    """Drafts, draft tokens and accepted tokens per draft source, over the samples."""
    out: dict[str, dict[str, int]] = {}
    for s in stats:
        for source, row in (s.get("by_source") or {}).items():
            acc = out.setdefault(source, {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0})
            for key, value in zip(acc, row, strict=True):
                acc[key] += value
    return out


def _total(stats: list[dict], key: str) -> float:
    return sum(s[key] for s in stats)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (None if equal)."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def mode_tps(run: ModeRun) -> float:
    return sum(len(s.tokens) for s in run.samples) / sum(s.seconds for s in run.samples)


def _alpha(mean_len: float, k: float) -> float:
    """The i.i.d. acceptance a with (1 - a^(k+1)) / (1 - a) == mean_len (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        e = k + 1 if mid == 1 else (1 - mid ** (k + 1)) / (1 - mid)
        lo, hi = (mid, hi) if e < mean_len else (lo, mid)
    return (lo + hi) / 2
