"""The gateway's core: its start-up, its limits and what every request shares.

`GatewayCore` (the base of the turns' `Gateway`, specdec.gateway.front.turn) holds what outlives a request: the replica fleet, the session index and its
turn locks, the recorder, and, once the replicas have answered Info (`start`), the
tokenizer, the limits a request must respect (specdec.gateway.job.Limits), the EOS ids
and the grammar engine; and across requests, the draft sources' acceptance priors and the
suffix cache. The session turn (specdec.gateway.front.turn) and a completion's rounds
(specdec.gateway.front.completion) run on it.
"""

from __future__ import annotations

import asyncio
import logging
import zlib

import grpc

from specdec.gateway.config import GatewayConfig
from specdec.gateway.fleet.dataplane import DataPlaneSettings
from specdec.gateway.fleet.placement import Placement
from specdec.gateway.fleet.replicas import Fleet
from specdec.gateway.job import Limits
from specdec.gateway.names import DraftMethod, KPolicy
from specdec.gateway.observe import metrics
from specdec.gateway.observe.recorder import Recorder
from specdec.gateway.round.grammar import Grammars
from specdec.gateway.round.lookup.settings import LookupSettings, SuffixParams
from specdec.gateway.round.lookup.suffix import SuffixCache
from specdec.gateway.round.policy import GoodputGuard, GuardParams, RoundGuard, SourcePriors
from specdec.gateway.round.policy.shared import SharedGuard
from specdec.gateway.sessions import SessionIndex, TurnLocks
from specdec.gateway.text import TextCodec
from specdec.sdk.request import Sampling
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)


def data_plane_settings(config: GatewayConfig) -> DataPlaneSettings | None:
    """How the gateway reaches the replicas' data ports: the replicas' TLS settings
    (--replica-ca, --replica-cert/--replica-key, --replica-server-name); None under
    --replica-transport grpc."""
    if config.replica_transport != "dataplane":
        return None
    tls = config.replica_tls
    return DataPlaneSettings(
        tls=tls.ssl_context() if tls is not None else None,
        server_name=tls.server_name if tls is not None else "",
        keepalive_interval=config.data_keepalive,
        keepalive_timeout=config.data_keepalive_timeout,
    )


class GatewayCore:
    """The replica fleet, the session index and the limits, shared by every request."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.fleet = Fleet(
            config.drafters,
            config.verifiers,
            dns_interval=config.dns_interval,
            credentials=config.replica_tls.credentials() if config.replica_tls else None,
            server_name=config.replica_tls.server_name if config.replica_tls else "",
            data_plane=data_plane_settings(config),
        )
        self.sessions = SessionIndex(config.redis_url, default_ttl=config.session_ttl)
        self.turns = TurnLocks(self.sessions)
        self.recorder: Recorder | None = None
        if config.record_dir:
            self.recorder = Recorder(
                config.record_dir, config.record_max_bytes, config.record_max_files
            )
        self.codec: TextCodec | None = None
        self.limits: Limits | None = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.grammars: Grammars | None = None  # structured output (specdec.gateway.round.grammar)
        self.grammars_error = "the gateway is still connecting to its replicas"
        # Each draft source's acceptance over the requests served: where a new request's
        # adaptive policy starts from (specdec.gateway.round.policy).
        self.source_priors = SourcePriors()

        # Speculation on or off by measured goodput at each load level, for every adaptive
        # request (specdec.gateway.round.policy.guard): of every gateway replica on the same
        # Redis (specdec.gateway.round.policy.shared), or of this one.
        def make_guard() -> GoodputGuard:
            params = GuardParams(min_measure=config.guard_epoch_seconds)
            return GoodputGuard(params, report=metrics.guard_epoch)

        self.guard: RoundGuard | None = None
        self.shared_guard: SharedGuard | None = None
        if config.goodput_guard and config.guard_scope == "shared" and self.sessions.redis:
            self.shared_guard = SharedGuard(
                self.sessions.redis,
                make_guard,
                on_role=lambda r: metrics.guard_role(r.value),
                on_delay=metrics.GUARD_EVENT_DELAY.observe,
            )
            self.guard = self.shared_guard
        elif config.goodput_guard:
            self.guard = make_guard()
        self._background: set[asyncio.Task[None]] = set()
        self.lookup_settings = LookupSettings(
            prompt_lookup_min=config.prompt_lookup_min,
            prompt_lookup_max=config.prompt_lookup_max,
            suffix=SuffixParams(
                depth=config.suffix_depth,
                max_match=min(SuffixParams.max_match, config.suffix_depth - 1),
            ),
        )
        # The cache of recent outputs for suffix drafts (this gateway replica's own).
        self.suffix_cache = (
            SuffixCache(config.suffix_cache_tokens, self.lookup_settings.suffix)
            if config.suffix_cache_scope != "off" and config.suffix_cache_tokens > 0
            else None
        )

    async def start(self) -> None:
        """Wait for the replicas, take their tokenizer and limits, start the probe."""
        info = await self.fleet.connect(self.config.startup_timeout)
        self.codec = TextCodec.from_info(info)
        infos = self.fleet.infos
        max_k = min(i.max_draft_tokens for i in infos)
        default_k = min(self.config.default_k, max_k)
        if default_k < self.config.default_k:
            log.warning(
                "--default-k is above what the replicas accept; using their maximum",
                extra={"default_k": self.config.default_k, "max_k": max_k},
            )
        self.limits = Limits(
            vocab_size=info.vocab_size,
            max_context=min(i.max_context for i in infos),
            max_k=max_k,
            default_k=default_k,
            default_ssd=self.config.ssd,
            default_k_policy=KPolicy.of(self.config.k_policy),
            max_new_tokens=self.config.max_new_tokens,
            default_ttl=self.config.session_ttl,
            max_session_ttl=self.config.max_session_ttl,
            default_method=DraftMethod.of(self.config.method),
            default_tree_width=self.config.tree_width,
            sampling_defaults=(
                Sampling.from_proto(info.sampling_defaults)
                if info.HasField("sampling_defaults")
                else None
            ),
        )
        self.eos_token_ids = frozenset(info.eos_token_ids)
        try:
            self.grammars = await asyncio.to_thread(
                Grammars,
                zlib.decompress(info.tokenizer_json_zlib).decode(),
                info.vocab_size,
                self.eos_token_ids,
            )
        except Exception as e:  # a tokenizer the engine cannot read: the rest still serves
            self.grammars_error = f"the grammar engine cannot use this tokenizer: {e}"
            log.warning("structured output unavailable", extra={"why": self.grammars_error})
        self.fleet.start_probe()
        if self.config.redis_url and not await self.sessions.ping():
            log.warning(
                "redis unreachable at start; sessions stay in this process until it is back"
            )
        if self.shared_guard is not None:
            await self.shared_guard.start()
        log.info(
            "gateway ready",
            extra={
                "drafters": list(self.config.drafters),
                "verifiers": list(self.config.verifiers),
                "vocab_size": self.limits.vocab_size,
                "max_context": self.limits.max_context,
                "max_k": self.limits.max_k,
            },
        )

    async def close(self) -> None:
        if self.shared_guard is not None:
            await self.shared_guard.close()
        await self.fleet.close()
        await self.turns.close()
        await self.sessions.close()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)

    def release_later(self, replica_session: str, *placements: Placement) -> None:
        """Drop a one-off request's KV caches (best effort, off the response path)."""

        async def release() -> None:
            for p in placements:
                if p.replica is not None and p.replica.up:
                    try:
                        await p.replica.stub.Release(
                            common_pb2.ReleaseRequest(session_id=replica_session), timeout=5
                        )
                    except grpc.RpcError as e:
                        log.info("release failed", extra={"replica": p.address, "why": e.details()})

        task = asyncio.ensure_future(release())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
