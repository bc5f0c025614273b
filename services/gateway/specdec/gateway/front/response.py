"""What a finished turn returns: the GenerateResponse, the stream's messages, the metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass

from specdec.gateway.job import Job
from specdec.gateway.names import Source
from specdec.gateway.observe import metrics
from specdec.gateway.outcome import RequestStats
from specdec.gateway.text import TextOutput
from specdec.v1 import common_pb2, gateway_pb2


@dataclass
class Event:
    """What one step of a request produced: a delta, and the response when finished."""

    text: str
    tokens: list[int]
    final: gateway_pb2.GenerateResponse | None = None
    # On the first delta only: ms from the request's arrival to its first token (progress).
    time_to_first_token_ms: float | None = None
    # Tokens the completion is conditioned on (history + prompt): a stream's running usage.
    context_tokens: int = 0
    # With logprobs: the delta's tokens scored; with prompt_logprobs, on the first delta
    # (or the final event), the prompt's scores (common_pb2.TokenLogprobs).
    logprobs: common_pb2.TokenLogprobs | None = None
    prompt_logprobs: common_pb2.TokenLogprobs | None = None
    # n > 1: the choice of this delta, and at a choice's end its GenerateChoice.
    index: int = 0
    choice: gateway_pb2.GenerateChoice | None = None


def build_response(
    job: Job,
    prompt_ids: list[int],
    history_tokens: int,
    output: TextOutput,
    stats: RequestStats,
    started: float,
    first_at: float | None,
) -> gateway_pb2.GenerateResponse:
    """The final answer of a turn; started / first_at are perf_counter() seconds."""
    _, predicted, accepted_predicted = stats.by_source.get(Source.PREDICTION, (0, 0, 0))
    assert output.finish_reason is not None  # a turn's final answer: it has finished
    return gateway_pb2.GenerateResponse(
        text=output.text,
        token_ids=output.tokens,
        finish_reason=output.finish_reason.proto,
        usage=gateway_pb2.Usage(
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(output.tokens),
            history_tokens=history_tokens,
            accepted_prediction_tokens=accepted_predicted,
            rejected_prediction_tokens=predicted - accepted_predicted,
        ),
        timings=gateway_pb2.Timings(
            time_to_first_token_ms=((first_at or started) - started) * 1e3,
            total_ms=(time.perf_counter() - started) * 1e3,
        ),
        stats=gateway_pb2.SpeculationStats(
            rounds=stats.rounds,
            draft_tokens=stats.draft_tokens,
            accepted_tokens=stats.accepted_tokens,
            acceptance_rate=stats.acceptance_rate,
            mean_accepted_length=stats.mean_accepted_length,
            accepted_per_position=stats.accepted_per_position,
            num_draft_tokens=job.speculation.k,
            ssd=job.speculation.ssd,
            ssd_hits=stats.ssd_hits,
            ssd_misses=stats.ssd_misses,
            ssd_branches=stats.ssd_branches,
            ssd_late=stats.ssd_late,
            ssd_speculates=stats.ssd_speculates,
            ssd_hidden_ms=stats.ssd_hidden_ms,
            drafter_wait_ms=stats.drafter_wait_ms,
            ssd_bytes=stats.ssd_bytes,
            cache_misses=stats.cache_misses,
            k_policy=job.speculation.k_policy.proto,
            rounds_by_k=stats.rounds_by_k,
            mean_k=stats.mean_k,
            policy_k0_rounds=stats.policy_k0_rounds,
            mean_fan_out=stats.mean_fan_out,
            ssd_paused_rounds=stats.ssd_paused_rounds,
            mean_verifier_queue=stats.mean_verifier_queue,
            method=job.speculation.method.proto,
            by_source=[
                gateway_pb2.DraftSourceStats(
                    source=source, drafts=row[0], draft_tokens=row[1], accepted_tokens=row[2]
                )
                for source, row in sorted(stats.by_source.items())
            ],
            lookup_no_match_rounds=stats.no_match_rounds,
            tree_rounds=stats.tree_rounds,
            tree_nodes=stats.tree_nodes,
            tree_other_branch_rounds=stats.tree_other_branch_rounds,
            feature_bytes=stats.feature_bytes,
        ),
        session_id=job.session.id or "",
    )


def stream_message(
    text: str,
    tokens: list[int],
    final: gateway_pb2.GenerateResponse | None,
    time_to_first_token_ms: float | None = None,
    *,
    logprobs: common_pb2.TokenLogprobs | None = None,
    prompt_logprobs: common_pb2.TokenLogprobs | None = None,
    index: int = 0,
    choice: gateway_pb2.GenerateChoice | None = None,
) -> gateway_pb2.GenerateStreamResponse:
    """One GenerateStream message: a delta, and on the last one the final fields; the
    first delta also carries the time to first token. n > 1: a choice's last message
    carries its finish reason and stats (`choice`), the stream's last one the rest."""
    msg = gateway_pb2.GenerateStreamResponse(text=text, token_ids=tokens, index=index)
    if time_to_first_token_ms is not None:
        msg.timings.time_to_first_token_ms = time_to_first_token_ms
    if logprobs is not None:
        msg.logprobs.CopyFrom(logprobs)
    if prompt_logprobs is not None:
        msg.prompt_logprobs.CopyFrom(prompt_logprobs)
    if choice is not None:
        msg.finish_reason = choice.finish_reason
        msg.stats.CopyFrom(choice.stats)
    if final is not None:
        if choice is None:
            msg.finish_reason = final.finish_reason
            msg.stats.CopyFrom(final.stats)
        msg.usage.CopyFrom(final.usage)
        msg.timings.CopyFrom(final.timings)
        msg.session_id = final.session_id
    return msg


def record_metrics(
    job: Job, stats: RequestStats, output: TextOutput, drafter_version: str = ""
) -> None:
    """Add a turn's figures to the gateway's Prometheus counters (finished or not);
    drafter_version labels the per-version acceptance counters."""
    s = stats
    if s.draft_tokens:
        metrics.NUM_DRAFT_TOKENS_BY_DRAFTER.labels(drafter_version=drafter_version).inc(
            s.draft_tokens
        )
        metrics.NUM_ACCEPTED_TOKENS_BY_DRAFTER.labels(drafter_version=drafter_version).inc(
            s.accepted_tokens
        )
    if output.finish_reason:
        metrics.REQUESTS.labels(finish_reason=output.finish_reason).inc()
    metrics.GENERATION_TOKENS.inc(len(output.tokens))
    metrics.NUM_DRAFTS.inc(s.drafts)
    metrics.NUM_DRAFT_TOKENS.inc(s.draft_tokens)
    metrics.NUM_ACCEPTED_TOKENS.inc(s.accepted_tokens)
    for pos, n in enumerate(s.accepted_per_position):
        metrics.ACCEPTED_PER_POS.labels(position=str(pos)).inc(n)
    metrics.CACHE_MISSES.inc(s.cache_misses)
    metrics.SSD_HITS.inc(s.ssd_hits)
    metrics.SSD_MISSES.inc(s.ssd_misses)
    metrics.SSD_BRANCHES.inc(s.ssd_branches)
    metrics.SSD_HIDDEN.inc(s.ssd_hidden_ms / 1e3)
    metrics.SSD_BYTES.inc(s.ssd_bytes)
    metrics.DRAFTER_WAIT.inc(s.drafter_wait_ms / 1e3)
    policy = job.speculation.k_policy
    for k, n in enumerate(s.rounds_by_k):
        if n:
            metrics.ROUNDS_BY_K.labels(k_policy=policy, k=str(k)).inc(n)
    metrics.POLICY_K0_ROUNDS.inc(s.policy_k0_rounds)
    metrics.SSD_FAN_OUT.inc(s.fan_out_sum)
    metrics.SSD_SPECULATES.inc(s.ssd_speculates)
    metrics.SSD_PAUSED_ROUNDS.inc(s.ssd_paused_rounds)
    for source, (drafts, draft_tokens, accepted) in s.by_source.items():
        metrics.DRAFTS_BY_METHOD.labels(method=source).inc(drafts)
        metrics.DRAFT_TOKENS_BY_METHOD.labels(method=source).inc(draft_tokens)
        metrics.ACCEPTED_BY_METHOD.labels(method=source).inc(accepted)
    metrics.LOOKUP_NO_MATCH.inc(s.no_match_rounds)
    metrics.TREE_ROUNDS.inc(s.tree_rounds)
    metrics.TREE_NODES.inc(s.tree_nodes)
    metrics.TREE_OTHER_BRANCH.inc(s.tree_other_branch_rounds)
