"""Gateway Prometheus metrics. Names follow vLLM's spec-decode metrics where one exists."""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)
PREFIX = "specdec_gateway_"

REQUESTS = Counter(PREFIX + "requests", "Finished requests", ["finish_reason"])
REQUEST_ERRORS = Counter(PREFIX + "request_errors", "Failed requests", ["code"])
IN_FLIGHT = Gauge(PREFIX + "requests_in_flight", "Requests being generated")
PROMPT_TOKENS = Counter(PREFIX + "prompt_tokens", "Prompt tokens processed")
GENERATION_TOKENS = Counter(PREFIX + "generation_tokens", "Tokens generated")
NUM_DRAFTS = Counter(PREFIX + "spec_decode_num_drafts", "Speculation rounds with a draft")
NUM_DRAFT_TOKENS = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed")
NUM_ACCEPTED_TOKENS = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted")
ACCEPTED_PER_POS = Counter(
    PREFIX + "spec_decode_num_accepted_tokens_per_pos",
    "Draft tokens accepted, by position in the draft",
    ["position"],
)
CACHE_MISSES = Counter(PREFIX + "replica_cache_misses", "Full-context resends after a cache miss")
# SSD hit rate = ssd_hits / (ssd_hits + ssd_misses); branches per round = ssd_branches /
# (ssd_hits + ssd_misses).
SSD_HITS = Counter(PREFIX + "ssd_hits", "SSD rounds whose outcome had a prepared draft")
SSD_MISSES = Counter(PREFIX + "ssd_misses", "SSD rounds whose outcome had no prepared draft")
SSD_BRANCHES = Counter(PREFIX + "ssd_branches", "Next-round drafts the drafter prepared")
SSD_HIDDEN = Counter(
    PREFIX + "ssd_hidden_drafter_seconds", "Drafter (Speculate) time overlapped by verification"
)
SSD_BYTES = Counter(PREFIX + "ssd_bytes", "Bytes of Speculate requests and responses")
DRAFTER_WAIT = Counter(
    PREFIX + "drafter_wait_seconds", "Time the speculation loop spent waiting for a drafter"
)
# Adaptive speculation (k_policy): mean k = sum(k * rounds{k}) / sum(rounds{k}); mean
# fan-out = ssd_fan_out / ssd_speculates.
ROUNDS_BY_K = Counter(
    PREFIX + "spec_decode_rounds_by_k",
    "Speculation rounds by the draft length they used, and the request's k policy",
    ["k_policy", "k"],
)
POLICY_K0_ROUNDS = Counter(
    PREFIX + "adaptive_k0_rounds",
    "Rounds the adaptive policy ran without a draft (verifier saturated or drafts not paying)",
)
# Speculation under load (docs/concepts/cost-model.md#under-load): the adaptive policy's
# choice by the verifier's load level (the cost bucket of the rows its forwards hold: 1, 2,
# 4, 8, 16), and its estimate of what speculating gains there. The crossover is the level
# where the rounds move to k = 0 and the gain to 1.
POLICY_ROUNDS_BY_LOAD = Counter(
    PREFIX + "policy_rounds_by_load",
    "Adaptive rounds by the verifier's rows per forward (its cost bucket) and the k chosen",
    ["rows", "k"],
)
POLICY_GAIN = Histogram(
    PREFIX + "policy_speculation_gain",
    "The adaptive policy's estimate of its chosen draft's tokens per second over k = 0's, "
    "by the verifier's rows per forward (1: speculation not paying)",
    ["rows"],
    buckets=(0.9, 1.0, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0),
)
POLICY_SATURATION = Histogram(
    PREFIX + "policy_verifier_saturation",
    "The verifier's saturation u the adaptive policy priced a round at: its busy share "
    "times the share of its rows that were other sessions'",
    buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0),
)
# The goodput guard (specdec.gateway.round.policy.guard): the tokens per second its last
# epoch of each mode measured at each load level (sessions, in powers of two), and its
# measured epochs by mode. Where `plain` measures more than `spec`, the guard runs the adaptive
# requests at k = 0.
GUARD_GOODPUT = Gauge(
    PREFIX + "guard_goodput_tokens_per_second",
    "Tokens per second the goodput guard's last epoch of a mode measured at a load level",
    ["level", "mode"],
)
GUARD_EPOCHS = Counter(
    PREFIX + "guard_epochs", "Epochs the goodput guard measured, by mode (spec, plain)", ["mode"]
)

GUARD_ROLE = Gauge(
    PREFIX + "guard_role",
    "1 for this replica's role in the goodput guard its replicas share (leader: it counts "
    "every replica's requests and decides; follower; alone: Redis unreachable)",
    ["role"],
)

GUARD_EVENT_DELAY = Histogram(
    PREFIX + "guard_event_delay_seconds",
    "On the replica leading the shared goodput guard: another replica's round event's "
    "seconds from its sending to its counting (the two machines' clocks)",
    buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
)


def guard_role(role: str) -> None:
    """This replica's role in the shared goodput guard, now."""
    for name in ("leader", "follower", "alone"):
        GUARD_ROLE.labels(role=name).set(1.0 if name == role else 0.0)


def guard_epoch(level: int, mode: str, tokens_per_s: float) -> None:
    """An epoch the goodput guard measured (its `report`), also logged."""
    GUARD_GOODPUT.labels(level=str(level), mode=mode).set(tokens_per_s)
    GUARD_EPOCHS.labels(mode=mode).inc()
    log.info(
        "goodput guard epoch",
        extra={"level": level, "mode": mode, "tokens_per_s": round(tokens_per_s, 3)},
    )


SSD_SPECULATES = Counter(PREFIX + "ssd_speculates", "Speculate calls sent")
SSD_FAN_OUT = Counter(PREFIX + "ssd_fan_out", "Branches asked for, summed over Speculates sent")
SSD_PAUSED_ROUNDS = Counter(
    PREFIX + "ssd_paused_rounds",
    "Rounds whose Speculate the adaptive policy held back (late even at fan-out 1)",
)
FAILOVERS = Counter(PREFIX + "replica_failovers", "Calls moved to another replica", ["role"])
REPLICAS = Gauge(PREFIX + "replicas", "Replicas this gateway knows, by state", ["role", "state"])
BUSY_REDIRECTS = Counter(
    PREFIX + "replica_busy_redirects",
    "Calls moved to another replica because one answered busy (full queue)",
    ["role"],
)
TTFT = Histogram(
    PREFIX + "time_to_first_token_seconds",
    "Time to first token",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
ITL = Histogram(
    PREFIX + "inter_token_latency_seconds",
    "Time per output token after the first",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
ROUND_SECONDS = Histogram(
    PREFIX + "round_seconds",
    "One speculation round: draft (or SSD hit), verify, and the Speculate it waited for",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
# Faults the loop absorbs (none of them fails a request).
SSD_FAILED = Counter(
    PREFIX + "ssd_speculate_failed", "Speculate calls that failed (counted as SSD misses)"
)
SSD_LATE = Counter(
    PREFIX + "ssd_speculate_late",
    "Speculate calls still running at the verdict (cancelled, not awaited)",
)
DRAFTER_FALLBACK = Counter(
    PREFIX + "drafter_fallback_rounds",
    "Rounds run at k = 0 because no drafter could draft (same output, no speculation)",
)
# Where drafts come from (specdec.gateway.round.lookup): "model" (the drafter, SSD's prepared
# drafts included), "ngram", "suffix", "prediction". Acceptance by method =
# accepted_tokens_by_method / draft_tokens_by_method.
DRAFTS_BY_METHOD = Counter(
    PREFIX + "spec_decode_num_drafts_by_method", "Rounds with a draft, by its source", ["method"]
)
DRAFT_TOKENS_BY_METHOD = Counter(
    PREFIX + "spec_decode_num_draft_tokens_by_method", "Draft tokens, by source", ["method"]
)
ACCEPTED_BY_METHOD = Counter(
    PREFIX + "spec_decode_num_accepted_tokens_by_method",
    "Draft tokens accepted, by source",
    ["method"],
)
LOOKUP_NO_MATCH = Counter(
    PREFIX + "lookup_no_match_rounds",
    "Rounds of a lookup method (ngram, suffix) that found nothing to draft",
)
TREE_ROUNDS = Counter(PREFIX + "tree_rounds", "Rounds that verified a token tree")
TREE_NODES = Counter(PREFIX + "tree_nodes", "Nodes of the token trees verified")
TREE_OTHER_BRANCH = Counter(
    PREFIX + "tree_other_branch_rounds",
    "Tree rounds whose accepted path took another branch than the draft's own",
)
# The cache of recent outputs for suffix drafts. Hit rate = hits / lookups.
SUFFIX_CACHE_TOKENS = Gauge(PREFIX + "suffix_cache_tokens", "Tokens of outputs in the suffix cache")
SUFFIX_CACHE_ENTRIES = Gauge(PREFIX + "suffix_cache_entries", "Outputs in the suffix cache")
SUFFIX_CACHE_LOOKUPS = Counter(PREFIX + "suffix_cache_lookups", "Suffix-cache look-ups (rounds)")
SUFFIX_CACHE_HITS = Counter(
    PREFIX + "suffix_cache_hits", "Suffix-cache look-ups that proposed a draft"
)
SUFFIX_CACHE_EVICTIONS = Counter(
    PREFIX + "suffix_cache_evictions", "Outputs evicted from the suffix cache (LRU)"
)
# A drafter that learns (docs/features/distill.md): acceptance per drafter model version
# (ModelInfo.model_version; "" for an unversioned drafter) = accepted / draft tokens.
NUM_DRAFT_TOKENS_BY_DRAFTER = Counter(
    PREFIX + "spec_decode_num_draft_tokens_by_drafter",
    "Draft tokens proposed, by the drafter's model version",
    ["drafter_version"],
)
NUM_ACCEPTED_TOKENS_BY_DRAFTER = Counter(
    PREFIX + "spec_decode_num_accepted_tokens_by_drafter",
    "Draft tokens accepted, by the drafter's model version",
    ["drafter_version"],
)
CANARY_FALLBACKS = Counter(
    PREFIX + "drafter_canary_fallbacks",
    "Drafter placements that found no up drafter of the session's canary side (any drafter used)",
)
# Recording (--record): rows written, their bytes, and rows dropped by reason (queue_full,
# too_large, write_error, bad_row); a dropped row never fails its request.
RECORD_ROWS = Counter(PREFIX + "record_rows", "Finished requests written to the recording")
RECORD_BYTES = Counter(PREFIX + "record_bytes", "Bytes written to the recording")
RECORD_DROPPED = Counter(
    PREFIX + "record_dropped_rows", "Finished requests not recorded, by reason", ["reason"]
)
# Sessions that survive crashes (docs/concepts/sessions.md): the turn lock's lease and the
# gateway's own copy of session records.
TURN_LOCK_WAIT = Histogram(
    PREFIX + "turn_lock_wait_seconds",
    "Time a session's turn waited for its turn lock, by outcome (acquired, busy)",
    ["outcome"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16),
)
TURN_LEASES_LAPSED = Counter(
    PREFIX + "turn_leases_lapsed",
    "Turn-lock leases that lapsed: this gateway's turn lost its own (holder=this), or a "
    "gateway that stopped renewing its lease lost the session to this one (holder=other)",
    ["holder"],
)
TURN_UNLOCKS_RETRIED = Counter(
    PREFIX + "turn_unlocks_retried",
    "Turn-lock releases that failed while the session store was unreachable and were "
    "retried until it answered",
)
SESSIONS_RESTORED = Counter(
    PREFIX + "sessions_restored",
    "Session records written back to the session store from this gateway's copy: the "
    "store lacked them (why=missing: restarted empty, evicted), held an older one "
    "written before an outage (why=outage), or held an older one because it lost this "
    "gateway's last write (why=stale: restarted from an AOF without its last second)",
    ["why"],
)
SESSIONS_LOST = Counter(
    PREFIX + "sessions_lost",
    "Turns refused because the session holds fewer turns than the request expected "
    "(its history was lost in the store and no gateway copy had it)",
)
for _holder in ("this", "other"):
    TURN_LEASES_LAPSED.labels(holder=_holder)
for _why in ("missing", "outage", "stale"):
    SESSIONS_RESTORED.labels(why=_why)
