"""Per (level, mode) metrics, named as vLLM's ``benchmark_serving`` names them where it has
a name: request_throughput, output_throughput, total_token_throughput, completed, failed,
and mean_/median_/p90_/p99_ of ttft_ms, tpot_ms, itl_ms and e2el_ms."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from specdec.sdk.loadtest.runner import Cell, RequestRecord

LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATS = (("mean", None), ("median", 50.0), ("p90", 90.0), ("p99", 99.0))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _latency_fields(name: str, values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values_s]
    out = {}
    for stat, q in STATS:
        value = (sum(ms) / len(ms) if ms else 0.0) if q is None else percentile(ms, q)
        out[f"{stat}_{name}_ms"] = value
    return out


def steady(records: Sequence[RequestRecord], concurrency: int) -> tuple[float, float]:
    """(output tokens per second, seconds) over the times when all `concurrency` users of
    a closed-loop level had a request in flight: the level's steady state, without the
    ramp at a slice's start (requests sent together, prefilling together) and the drain
    at its end (the last requests finishing with fewer users left: unequal requests, as
    speculation makes them, drain longer). A token counts at the time its chunk arrived.
    (0, 0) when the level never had all its users in flight."""
    chunk, end, send = 0, 1, 2  # at one time: chunks, then ends, then sends
    events = []
    for r in records:
        if r.ended_s <= 0.0:
            continue
        events += [(r.sent_s, send, 0), (r.ended_s, end, 0)]
        events += [(t, chunk, n) for t, n in r.chunks]
    events.sort()
    in_flight, since, seconds, tokens = 0, 0.0, 0.0, 0
    for t, kind, n in events:
        full = in_flight >= concurrency
        if kind == chunk:
            tokens += n if full else 0
            continue
        if full:
            seconds += t - since
        in_flight += 1 if kind == send else -1
        since = t
    return (tokens / seconds if seconds > 0 else 0.0), seconds


def summarize(
    cell: Cell, references: Mapping[tuple[int, int], tuple[int, ...]] | None = None
) -> dict[str, Any]:
    """The metrics of one cell; with references, the exactness counters too."""
    ok: list[RequestRecord] = [r for r in cell.records if r.ok]
    failed = [r for r in cell.records if not r.ok]
    duration = cell.duration_s
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    rounds = sum(r.rounds for r in ok)
    drafted = sum(r.draft_tokens for r in ok)
    accepted = sum(r.accepted_tokens for r in ok)
    ssd = sum(r.ssd_hits + r.ssd_misses for r in ok)
    result: dict[str, Any] = {
        "level": cell.level.label,
        **cell.level.to_dict(),
        "mode": cell.mode.name,
        "k": cell.mode.k,
        "ssd": cell.mode.ssd,
        "k_policy": cell.mode.k_policy,
        "method": cell.mode.method,
        "tree_width": cell.mode.tree_width,
        "served_methods": sorted({r.method for r in ok}),  # what the gateway reported
        "completed": len(ok),
        "failed": len(failed),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0
        else 0.0,
    }
    if cell.level.concurrency is not None:
        rate, seconds = steady(cell.records, cell.level.concurrency)
        result["steady_output_throughput"], result["steady_duration"] = rate, seconds
    samples = {
        "ttft": [r.ttft_s for r in ok if r.output_tokens > 0],
        # Time per output token after the first, per request with more than one.
        "tpot": [(r.e2el_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2el_s for r in ok],
    }
    for name in LATENCIES:
        result.update(_latency_fields(name, samples[name]))
    result.update(
        {
            # Accepted draft tokens / draft tokens; tokens per verification round
            # (accepted + 1); SSD rounds whose outcome had a prepared draft.
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_round": (accepted + rounds) / rounds if rounds else 0.0,
            # Draft tokens per round: the k the rounds used (adaptive modes choose it).
            "mean_k": drafted / rounds if rounds else 0.0,
            "ssd_hit_rate": sum(r.ssd_hits for r in ok) / ssd if ssd else 0.0,
            "tree_rounds": sum(r.tree_rounds for r in ok),
            "errors": dict(sorted(Counter(r.error for r in failed).items())),
        }
    )
    if references is not None:
        checked = [r for r in ok if (r.conversation, r.turn) in references]
        differ = [r for r in checked if r.tokens != references[(r.conversation, r.turn)]]
        result["exact_checked"] = len(checked)
        result["exact_mismatches"] = len(differ)
        result["exact_mismatch_examples"] = [
            {
                "conversation": r.conversation,
                "turn": r.turn,
                "first_difference": _first_difference(
                    r.tokens, references[(r.conversation, r.turn)]
                ),
            }
            for r in differ[:5]
        ]
    return result


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))
