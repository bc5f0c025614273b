"""Typed results of a generation, and their conversion from the gateway's proto messages."""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any

from specdec.sdk.errors import InternalError
from specdec.sdk.names import DraftMethod, Finish, KPolicy, WireEnum
from specdec.sdk.request import Sampling
from specdec.v1 import common_pb2, gateway_pb2

__all__ = [
    "Choice",
    "Generation",
    "ServerInfo",
    "SpeculationStats",
    "StreamAssembler",
    "StreamChunk",
    "Timings",
    "TokenLogprob",
    "Usage",
    "finish_reason_from_proto",
    "generation_from_proto",
    "server_info_from_proto",
    "speculation_stats_from_proto",
    "timings_from_proto",
    "usage_from_proto",
]


def _name(kind: type[WireEnum], value: int) -> str:
    """The name of a proto enum value ("" for UNSPECIFIED or one this version does not
    know: a newer server's)."""
    try:
        return kind.of(value).value
    except KeyError:
        return ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: Tokens of earlier turns of the session this request continued from.
    history_tokens: int = 0
    #: Draft tokens from the request's prediction the verifier accepted / rejected.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    #: A session's turns after this one: its next turn's ``session_expected_turns``.
    session_turns: int = 0


@dataclass(frozen=True)
class Timings:
    time_to_first_token_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True)
class SpeculationStats:
    #: Verification rounds (target forward passes).
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    #: accepted_tokens / draft_tokens (0 when nothing was drafted).
    acceptance_rate: float = 0.0
    #: Tokens produced per round (accepted + 1).
    mean_accepted_length: float = 0.0
    #: accepted_per_position[i]: rounds whose draft token i was accepted.
    accepted_per_position: tuple[int, ...] = ()
    #: Draft length the request ran with.
    num_draft_tokens: int = 0
    ssd: bool = False
    ssd_hits: int = 0
    ssd_misses: int = 0
    #: Full-context resends: a replica cache miss, a failover, or a session continued on
    #: another replica than the one holding its cache (it was down or gone).
    cache_misses: int = 0
    #: SSD: next-round drafts the drafter prepared, over all rounds.
    ssd_branches: int = 0
    #: SSD: drafter time that ran while the verifier worked (ms).
    ssd_hidden_ms: float = 0.0
    #: Time the gateway waited for the drafter (Draft calls, late Speculate answers; ms).
    drafter_wait_ms: float = 0.0
    #: SSD: bytes of Speculate requests and responses.
    ssd_bytes: int = 0
    #: SSD: Speculates still running at their verdict (cancelled; their branches are not
    #: in ssd_branches, though a later Draft may still be served from them).
    ssd_late: int = 0
    #: SSD: Speculates sent (answered before their verdict, late, or failed).
    ssd_speculates: int = 0
    #: "fixed" or "adaptive": how each round's k was picked (num_draft_tokens is then the
    #: upper bound); "" from a server that does not say.
    k_policy: str = ""
    #: rounds_by_k[k]: rounds that drafted k tokens (index 0: rounds without a draft).
    rounds_by_k: tuple[int, ...] = ()
    #: Mean draft length over the rounds.
    mean_k: float = 0.0
    #: Rounds the adaptive policy ran at k = 0 by its own choice.
    policy_k0_rounds: int = 0
    #: SSD: mean fan-out asked for per Speculate sent (0 for the drafter's default).
    mean_fan_out: float = 0.0
    #: SSD: rounds whose Speculate the adaptive policy held back (late even at fan-out 1).
    ssd_paused_rounds: int = 0
    #: Mean queue depth the verifier reported per round (its load).
    mean_verifier_queue: float = 0.0
    #: Where drafts came from: "model", "ngram", "suffix" or "hybrid" ("" from a server
    #: that does not say).
    method: str = ""
    #: Per draft source ("model", "ngram", "suffix", "prediction"): (drafts, draft tokens,
    #: accepted tokens).
    by_source: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    #: Rounds of a lookup method that found nothing to draft.
    lookup_no_match_rounds: int = 0
    #: Rounds that verified a token tree, their nodes, and those whose accepted path took
    #: another branch than the draft's own.
    tree_rounds: int = 0
    tree_nodes: int = 0
    tree_other_branch_rounds: int = 0
    #: A head drafter's: bytes of the target's features the verifier returned for it.
    feature_bytes: int = 0
    #: The model version of the drafter that served the request ("" when none).
    drafter_version: str = ""
    #: Whether the gateway recorded the request (``--record``; ``record=False`` refuses).
    recorded: bool = False

    @property
    def ssd_hit_rate(self) -> float:
        """Share of SSD rounds whose outcome had a prepared draft (0 without SSD)."""
        n = self.ssd_hits + self.ssd_misses
        return self.ssd_hits / n if n else 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """One token scored by the target: log_softmax of its logits before temperature."""

    token_id: int
    #: None for a prompt's first token (nothing to score it against).
    logprob: float | None
    #: The most likely tokens at its position, (token id, log-probability), best first.
    top: tuple[tuple[int, float], ...] = ()


def logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> tuple[TokenLogprob, ...]:
    """A TokenLogprobs message as TokenLogprob rows (its scores cover its last tokens)."""
    n, m, top = len(msg.token_ids), len(msg.logprobs), msg.num_top
    out = []
    for i, token in enumerate(msg.token_ids):
        j = i - (n - m)
        if j < 0:
            out.append(TokenLogprob(token, None))
            continue
        pairs = zip(
            msg.top_token_ids[j * top : (j + 1) * top],
            msg.top_logprobs[j * top : (j + 1) * top],
            strict=True,
        )
        out.append(TokenLogprob(token, msg.logprobs[j], tuple(pairs)))
    return tuple(out)


@dataclass(frozen=True)
class Choice:
    """One of the n completions of a request (``Generation.choices``)."""

    index: int
    text: str
    tokens: tuple[int, ...]
    finish_reason: str
    stats: SpeculationStats
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Generation:
    """A finished generation: what ``Client.generate`` returns and a stream's ``final``."""

    text: str
    #: Completion token ids (the prompt is not included).
    tokens: tuple[int, ...]
    #: "length" | "eos" | "stop" ("unknown" only if the server did not say).
    finish_reason: str
    usage: Usage
    timings: Timings
    stats: SpeculationStats
    #: The session continued (or created); "" for a one-off request.
    session_id: str = ""
    #: The gateway's trace id of this request (32 hex digits, to look up in Jaeger); ""
    #: when the gateway does not trace or did not sample it.
    trace_id: str = ""
    #: With logprobs=True: each token of ``tokens`` scored.
    logprobs: tuple[TokenLogprob, ...] | None = None
    #: With prompt_logprobs=True: the prompt's tokens, the first unscored.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    #: n > 1: every completion (the fields above are choice 0's; usage counts them all).
    choices: tuple[Choice, ...] = ()

    @property
    def tokens_per_second(self) -> float:
        """Completion tokens per second of server time (0 when the server gave no timing)."""
        if self.timings.total_ms <= 0:
            return 0.0
        return self.usage.completion_tokens / (self.timings.total_ms / 1000.0)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (lists for sequences, plain str/int/float/bool values)."""
        s = self.stats
        return {
            "text": self.text,
            "tokens": list(self.tokens),
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "completion_tokens": self.usage.completion_tokens,
                "history_tokens": self.usage.history_tokens,
                "accepted_prediction_tokens": self.usage.accepted_prediction_tokens,
                "rejected_prediction_tokens": self.usage.rejected_prediction_tokens,
                "session_turns": self.usage.session_turns,
            },
            "timings": {
                "time_to_first_token_ms": self.timings.time_to_first_token_ms,
                "total_ms": self.timings.total_ms,
            },
            "stats": {
                **dataclasses.asdict(s),
                "accepted_per_position": list(s.accepted_per_position),
                "rounds_by_k": list(s.rounds_by_k),
                "ssd_hit_rate": s.ssd_hit_rate,
            },
            "session_id": self.session_id,
            "trace_id": self.trace_id,
        }


@dataclass(frozen=True)
class StreamChunk:
    """One streamed step: the text and tokens new since the previous chunk.

    The last chunk of a stream has ``final`` set; its text and tokens are those of the
    whole generation (the concatenation of every chunk's deltas).
    """

    text: str
    tokens: tuple[int, ...]
    final: Generation | None = None
    #: On the first chunk with tokens: ms from the request's arrival to its first token.
    time_to_first_token_ms: float | None = None
    #: With logprobs=True: this chunk's tokens scored.
    logprobs: tuple[TokenLogprob, ...] | None = None


def _f32(x: float) -> float:
    """The shortest decimal that is the same float32 (0.8f reads 0.8, not 0.800000011920929)."""
    packed = struct.pack("<f", x)
    for digits in range(6, 10):
        y = float(f"{x:.{digits}g}")
        if struct.pack("<f", y) == packed:
            return y
    return float(x)


def finish_reason_from_proto(reason: int) -> str:
    return _name(Finish, reason) or "unknown"


def usage_from_proto(msg: gateway_pb2.Usage) -> Usage:
    return Usage(
        prompt_tokens=msg.prompt_tokens,
        completion_tokens=msg.completion_tokens,
        history_tokens=msg.history_tokens,
        accepted_prediction_tokens=msg.accepted_prediction_tokens,
        rejected_prediction_tokens=msg.rejected_prediction_tokens,
        session_turns=msg.session_turns,
    )


def timings_from_proto(msg: gateway_pb2.Timings) -> Timings:
    return Timings(
        time_to_first_token_ms=_f32(msg.time_to_first_token_ms),
        total_ms=_f32(msg.total_ms),
    )


def speculation_stats_from_proto(msg: gateway_pb2.SpeculationStats) -> SpeculationStats:
    return SpeculationStats(
        rounds=msg.rounds,
        draft_tokens=msg.draft_tokens,
        accepted_tokens=msg.accepted_tokens,
        acceptance_rate=_f32(msg.acceptance_rate),
        mean_accepted_length=_f32(msg.mean_accepted_length),
        accepted_per_position=tuple(msg.accepted_per_position),
        num_draft_tokens=msg.num_draft_tokens,
        ssd=msg.ssd,
        ssd_hits=msg.ssd_hits,
        ssd_misses=msg.ssd_misses,
        cache_misses=msg.cache_misses,
        ssd_branches=msg.ssd_branches,
        ssd_hidden_ms=msg.ssd_hidden_ms,
        drafter_wait_ms=msg.drafter_wait_ms,
        ssd_bytes=msg.ssd_bytes,
        ssd_late=msg.ssd_late,
        ssd_speculates=msg.ssd_speculates,
        k_policy=_name(KPolicy, msg.k_policy),
        rounds_by_k=tuple(msg.rounds_by_k),
        mean_k=_f32(msg.mean_k),
        policy_k0_rounds=msg.policy_k0_rounds,
        mean_fan_out=_f32(msg.mean_fan_out),
        ssd_paused_rounds=msg.ssd_paused_rounds,
        mean_verifier_queue=_f32(msg.mean_verifier_queue),
        method=_name(DraftMethod, msg.method),
        by_source={s.source: (s.drafts, s.draft_tokens, s.accepted_tokens) for s in msg.by_source},
        lookup_no_match_rounds=msg.lookup_no_match_rounds,
        tree_rounds=msg.tree_rounds,
        tree_nodes=msg.tree_nodes,
        tree_other_branch_rounds=msg.tree_other_branch_rounds,
        feature_bytes=msg.feature_bytes,
        drafter_version=msg.drafter_version,
        recorded=msg.recorded,
    )


def _generation(
    msg: gateway_pb2.GenerateResponse | gateway_pb2.GenerateStreamResponse,
    text: str,
    tokens: tuple[int, ...],
) -> Generation:
    return Generation(
        text=text,
        tokens=tokens,
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        usage=usage_from_proto(msg.usage),
        timings=timings_from_proto(msg.timings),
        stats=speculation_stats_from_proto(msg.stats),
        session_id=msg.session_id,
        trace_id=msg.trace_id,
    )


def generation_from_proto(msg: gateway_pb2.GenerateResponse) -> Generation:
    """The result of a unary ``Generate`` call."""
    generation = _generation(msg, msg.text, tuple(msg.token_ids))
    return dataclasses.replace(
        generation,
        logprobs=logprobs_from_proto(msg.logprobs) if msg.HasField("logprobs") else None,
        prompt_logprobs=(
            logprobs_from_proto(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None
        ),
        choices=tuple(
            Choice(
                index=c.index,
                text=c.text,
                tokens=tuple(c.token_ids),
                finish_reason=finish_reason_from_proto(c.finish_reason),
                stats=speculation_stats_from_proto(c.stats),
                logprobs=logprobs_from_proto(c.logprobs) if c.HasField("logprobs") else None,
            )
            for c in msg.choices
        ),
    )


class StreamAssembler:
    """Turns ``GenerateStreamResponse`` messages into :class:`StreamChunk` s.

    The final message is the one with a finish reason set: its chunk carries ``final``, a
    :class:`Generation` with the concatenated text and tokens and the final message's
    usage, timings, statistics and session id. Shared by the sync and asyncio clients.
    """

    def __init__(self) -> None:
        self._text: list[str] = []
        self._tokens: list[int] = []
        self._logprobs: list[TokenLogprob] | None = None
        self._prompt: tuple[TokenLogprob, ...] | None = None
        self.final: Generation | None = None

    def feed(self, msg: gateway_pb2.GenerateStreamResponse) -> StreamChunk:
        if self.final is not None:
            raise InternalError("gateway stream sent a message after its final message")
        text, tokens = msg.text, tuple(msg.token_ids)
        self._text.append(text)
        self._tokens.extend(tokens)
        scores = logprobs_from_proto(msg.logprobs) if msg.HasField("logprobs") else None
        if scores is not None:
            self._logprobs = [*(self._logprobs or []), *scores]
        if msg.HasField("prompt_logprobs"):
            self._prompt = logprobs_from_proto(msg.prompt_logprobs)
        ttft = None
        if msg.finish_reason != gateway_pb2.FINISH_REASON_UNSPECIFIED:
            self.final = dataclasses.replace(
                _generation(msg, "".join(self._text), tuple(self._tokens)),
                logprobs=None if self._logprobs is None else tuple(self._logprobs),
                prompt_logprobs=self._prompt,
            )
        elif msg.HasField("timings"):
            ttft = _f32(msg.timings.time_to_first_token_ms)
        return StreamChunk(
            text=text,
            tokens=tokens,
            final=self.final,
            time_to_first_token_ms=ttft,
            logprobs=scores,
        )

    def finish(self) -> Generation:
        """Call when the stream ended normally: the final generation, or InternalError."""
        if self.final is None:
            raise InternalError("gateway stream ended without a final message")
        return self.final


@dataclass(frozen=True)
class ServerInfo:
    """The model behind a gateway and the limits of a request (``Client.server_info()``)."""

    model_id: str
    draft_model_id: str
    #: Valid token ids are 0..vocab_size-1.
    vocab_size: int
    #: Tokens of history + prompt + max_new_tokens a request may reach.
    max_context: int
    max_k: int
    default_k: int
    default_ssd: bool
    max_new_tokens: int
    max_stop_strings: int
    max_stop_chars: int
    max_session_id_chars: int
    default_session_ttl_seconds: int
    max_session_ttl_seconds: int
    #: sha256 of the tokenizer's canonical JSON.
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]
    #: -1 when the tokenizer has none.
    bos_token_id: int
    #: Optional request fields the gateway supports (ignore_eos, min_tokens, ...).
    supported_request_fields: tuple[str, ...] = ()
    max_stop_token_ids: int = 0
    max_logit_bias: int = 0
    #: The grammar engine behind ``structured_output`` (e.g. "llguidance 1.9.1").
    structured_output_engine: str = ""
    #: The structured_output kinds accepted: json_object, json_schema, regex, choice.
    structured_output_kinds: tuple[str, ...] = ()
    #: The method a request gets when it sets none ("" from a server that does not say).
    default_method: str = ""
    #: The gateway's lookup settings: prompt_lookup_min / max, suffix_depth,
    #: suffix_cache_tokens, suffix_cache_scope.
    lookup: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: The gateway records finished requests (``--record``) unless one sets record=False.
    recording: bool = False
    #: Model versions of the drafters it has admitted ("" for an unversioned drafter).
    drafter_versions: tuple[str, ...] = ()
    #: ``--drafter-canary``: the version that gets a share of new sessions, and the share.
    drafter_canary_version: str = ""
    drafter_canary_percent: float = 0.0
    #: What a request's unset sampling fields become: the model's generation_config
    #: (docs: Sampling and its defaults); every field set. None from an older server.
    sampling_defaults: Sampling | None = None


def server_info_from_proto(msg: gateway_pb2.GetServerInfoResponse) -> ServerInfo:
    return ServerInfo(
        model_id=msg.model_id,
        draft_model_id=msg.draft_model_id,
        vocab_size=msg.vocab_size,
        max_context=msg.max_context,
        max_k=msg.max_num_draft_tokens,
        default_k=msg.default_num_draft_tokens,
        default_ssd=msg.default_ssd,
        max_new_tokens=msg.max_new_tokens,
        max_stop_strings=msg.max_stop_strings,
        max_stop_chars=msg.max_stop_chars,
        max_session_id_chars=msg.max_session_id_chars,
        default_session_ttl_seconds=msg.default_session_ttl_seconds,
        max_session_ttl_seconds=msg.max_session_ttl_seconds,
        tokenizer_fingerprint=msg.tokenizer_fingerprint,
        eos_token_ids=tuple(msg.eos_token_ids),
        bos_token_id=msg.bos_token_id,
        supported_request_fields=tuple(msg.supported_request_fields),
        max_stop_token_ids=msg.max_stop_token_ids,
        max_logit_bias=msg.max_logit_bias,
        structured_output_engine=msg.structured_output_engine,
        structured_output_kinds=tuple(msg.structured_output_kinds),
        default_method=_name(DraftMethod, msg.default_method),
        lookup={f.name: getattr(msg.lookup, f.name) for f in msg.lookup.DESCRIPTOR.fields},
        recording=msg.recording,
        drafter_versions=tuple(msg.drafter_versions),
        drafter_canary_version=msg.drafter_canary_version,
        drafter_canary_percent=msg.drafter_canary_percent,
        sampling_defaults=(
            Sampling.from_proto(msg.sampling_defaults)
            if msg.HasField("sampling_defaults")
            else None
        ),
    )
