"""Running a load test: levels x modes, interleaved, each request timed from the client.

Each (level, mode) is one *cell*. A cell's requests are split into ``slices``; slice 1 of
every level and mode runs, then slice 2, and so on, the modes of a level in an order that
rotates from slice to slice, so that drift of the machine hits every mode and level alike. A slice keeps ``concurrency`` conversations in
flight (or starts conversations at Poisson arrival times for a ``rate`` level) until its
share of ``num_requests`` has been sent or its share of ``duration`` has passed; requests
already sent then finish (each bounded by the request timeout). Nothing runs unbounded.

Timing per request, measured by the client on the streaming call: TTFT (send to the first
chunk with tokens), inter-token latency (between chunks with tokens; a speculation round
may deliver several tokens in one chunk), end-to-end latency; the final message carries the
usage and the speculation statistics.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specdec.sdk.client import AsyncClient
from specdec.sdk.errors import SpecdecError
from specdec.sdk.loadtest.workload import Conversation, Level, Mode, RequestSettings
from specdec.sdk.progress import Progress
from specdec.sdk.types import StreamChunk


@dataclass
class RequestRecord:
    """One request (one turn) as the load test saw it."""

    level: str
    mode: str
    conversation: int
    turn: int
    ok: bool = False
    error: str = ""  # gRPC status name of a failed request
    details: str = ""
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    sent_s: float = 0.0  # perf_counter() when it was sent
    ended_s: float = 0.0  # ... when its stream ended (its last chunk, or its error)
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter(), tokens)
    prompt_tokens: int = 0
    output_tokens: int = 0
    tokens: tuple[int, ...] = ()
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    ssd_hits: int = 0
    ssd_misses: int = 0
    method: str = ""  # where the gateway took drafts from ("" when not reported)
    tree_rounds: int = 0  # rounds that verified a token tree


class Backend(Protocol):
    """An API the load test can drive. ``stream`` yields the SDK's StreamChunk s (tokens
    per chunk; the last has ``final``, a Generation with usage and speculation stats) and
    raises ``specdec.sdk.SpecdecError`` (with its gRPC-style code) on failure."""

    name: str

    def stream(
        self,
        text: str,
        mode: Mode,
        settings: RequestSettings,
        seed: int | None,
        session_id: str | None,
        first_turn: bool,
    ) -> AsyncIterator[StreamChunk]: ...

    async def close(self) -> None: ...

    async def suffix_cache_scope(self) -> str | None:
        """Who shares the gateway's cache of recent outputs for suffix drafts: "global",
        "tenant" or "off" (also when it holds no tokens); None: the API does not say."""
        ...


class GrpcBackend:
    """The specdec gateway's gRPC API through the SDK's AsyncClient."""

    name = "grpc"

    def __init__(self, address: str, timeout: float):
        self.address = address
        self.client = AsyncClient(address, timeout=timeout)

    def stream(
        self,
        text: str,
        mode: Mode,
        settings: RequestSettings,
        seed: int | None,
        session_id: str | None,
        first_turn: bool,
    ) -> AsyncIterator[StreamChunk]:
        return self.client.stream(
            text,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            seed=seed,
            stop=settings.stop,
            session_id=session_id,
            reset_session=bool(session_id) and first_turn,
            k=mode.k,
            ssd=mode.ssd,
            k_policy=mode.k_policy,
            method=mode.method,
            tree_width=mode.tree_width,
        )

    async def suffix_cache_scope(self) -> str | None:
        try:
            lookup = (await self.client.server_info()).lookup
        except SpecdecError:  # unreachable: the requests' own errors will say so
            return None
        if not lookup.get("suffix_cache_tokens"):
            return "off"
        return str(lookup.get("suffix_cache_scope") or "global")

    async def close(self) -> None:
        await self.client.close()


def _openai_backend(address: str, timeout: float) -> Backend:
    from specdec.sdk.loadtest.openai_api import OpenAIBackend

    return OpenAIBackend(address, timeout)


#: --api choices: name -> factory(address, timeout).
BACKENDS: dict[str, Callable[[str, float], Backend]] = {
    "grpc": GrpcBackend,
    "openai": _openai_backend,  # the gateway's OpenAI-compatible HTTP API (--http-port)
}


async def run_request(
    backend: Backend,
    record: RequestRecord,
    text: str,
    mode: Mode,
    settings: RequestSettings,
    seed: int | None,
    session_id: str | None,
) -> RequestRecord:
    """Send one turn, streaming, and fill record with its timings and result."""
    sent = record.sent_s = time.perf_counter()
    last = None
    try:
        async for chunk in backend.stream(
            text, mode, settings, seed, session_id, first_turn=record.turn == 0
        ):
            now = time.perf_counter()
            if chunk.tokens:
                record.chunks.append((now, len(chunk.tokens)))
                if last is None:
                    record.ttft_s = now - sent
                else:
                    record.itl_s.append(now - last)
                last = now
            if chunk.final is not None:
                final = chunk.final
                record.e2el_s = now - sent
                record.tokens = final.tokens
                record.output_tokens = final.usage.completion_tokens
                record.prompt_tokens = final.usage.prompt_tokens
                s = final.stats
                record.rounds, record.draft_tokens = s.rounds, s.draft_tokens
                record.accepted_tokens = s.accepted_tokens
                record.ssd_hits, record.ssd_misses = s.ssd_hits, s.ssd_misses
                record.method = s.method
                record.tree_rounds = s.tree_rounds
                record.ok = True
    except SpecdecError as e:
        record.ok, record.error, record.details = False, e.code.name, e.details
    record.ended_s = time.perf_counter()
    return record


@dataclass
class Cell:
    """What one (level, mode) gathered over its slices."""

    level: Level
    mode: Mode
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0  # sum of its slices' wall times
    conversations_started: int = 0


class LoadTest:
    """Runs every level x mode against one backend; results in ``cells``."""

    def __init__(
        self,
        backend: Backend,
        conversations: Sequence[Conversation],
        modes: Sequence[Mode],
        levels: Sequence[Level],
        settings: RequestSettings,
        num_requests: int | None,
        duration: float | None,
        slices: int = 1,
        progress: Progress | None = None,
        seed: int = 0,
    ):
        if num_requests is None and duration is None:
            raise ValueError("a load test needs --num-requests or --duration (or both)")
        if num_requests is not None and num_requests < 1:
            raise ValueError("--num-requests must be at least 1")
        if duration is not None and not duration > 0:
            raise ValueError("--duration must be > 0 seconds")
        if slices < 1:
            raise ValueError("--slices must be at least 1")
        if num_requests is not None and slices > num_requests:
            slices = num_requests
        if num_requests is not None:
            # A slice of fewer requests than a level's users never has them all in flight.
            fewest = num_requests // slices
            for level in levels:
                if level.concurrency is not None and level.concurrency > fewest:
                    raise ValueError(
                        f"concurrency {level.concurrency} with --num-requests {num_requests} "
                        f"over {slices} slices: a slice of {fewest} requests never has "
                        f"{level.concurrency} in flight; give --num-requests of at least "
                        f"{level.concurrency * slices} (or fewer --slices)"
                    )
        self.backend = backend
        self.conversations = list(conversations)
        self.modes = list(modes)
        self.levels = list(levels)
        self.settings = settings
        self.num_requests = num_requests
        self.duration = duration
        self.slices = slices
        self.progress = progress or Progress(None, None, enabled=False)
        self.random = random.Random(seed)
        self.run_id = uuid.uuid4().hex[:8]
        self.cells = {(lv.label, m.name): Cell(lv, m) for lv in self.levels for m in self.modes}

    async def run(self) -> list[Cell]:
        for s in range(self.slices):
            for level in self.levels:
                shift = s % len(self.modes)
                for mode in self.modes[shift:] + self.modes[:shift]:
                    await self._slice(self.cells[(level.label, mode.name)], s)
        self.progress.close()
        return list(self.cells.values())

    def _share(self, s: int) -> tuple[int | None, float | None]:
        """Requests and seconds of slice s of a cell."""
        count = None
        if self.num_requests is not None:
            base, extra = divmod(self.num_requests, self.slices)
            count = base + (s < extra)
        seconds = None if self.duration is None else self.duration / self.slices
        return count, seconds

    async def _slice(self, cell: Cell, s: int) -> None:
        count, seconds = self._share(s)
        self.progress.begin(f"{cell.level.label} {cell.mode.name} slice {s + 1}/{self.slices}")
        started = time.perf_counter()
        deadline = None if seconds is None else started + seconds
        budget = {"left": count}

        def expired() -> bool:
            return deadline is not None and time.perf_counter() >= deadline

        def claim() -> bool:
            """Take one request of the slice's budget (False: the slice is done)."""
            if expired():
                return False
            if budget["left"] is not None:
                if budget["left"] <= 0:
                    return False
                budget["left"] -= 1
            return True

        def next_conversation() -> tuple[Conversation, int]:
            n = cell.conversations_started
            cell.conversations_started += 1
            return self.conversations[n % len(self.conversations)], n

        async def converse() -> None:
            conversation, n = next_conversation()
            session = None
            if len(conversation.turns) > 1:
                session = f"loadtest-{self.run_id}-{cell.level.label}-{cell.mode.name}-{n}"
            for t, text in enumerate(conversation.turns):
                if t > 0 and not claim():
                    return
                record = RequestRecord(cell.level.label, cell.mode.name, conversation.index, t)
                await run_request(
                    self.backend,
                    record,
                    text,
                    cell.mode,
                    self.settings.for_turn(conversation, t),
                    self.settings.seed_for(conversation),
                    session,
                )
                cell.records.append(record)
                self.progress.advance(record.ok)
                if not record.ok:
                    return  # the rest of the conversation builds on this turn

        if cell.level.concurrency is not None:

            async def user() -> None:
                while claim():
                    await converse()

            await asyncio.gather(*(user() for _ in range(cell.level.concurrency)))
        else:
            await self._poisson(cell.level, claim, expired, converse)
        cell.duration_s += time.perf_counter() - started
        self.progress.end_slice()

    async def _poisson(
        self,
        level: Level,
        claim: Callable[[], bool],
        expired: Callable[[], bool],
        converse: Callable[[], Awaitable[None]],
    ) -> None:
        """Start a conversation at exponential intervals of mean 1/rate (a Poisson process)."""
        assert level.rate is not None
        cap = asyncio.Semaphore(level.max_concurrency) if level.max_concurrency else None
        tasks: set[asyncio.Task[None]] = set()

        async def limited() -> None:
            if cap is None:
                await converse()
                return
            async with cap:
                await converse()

        first = True
        while claim():  # claimed before the gap: no idle gap after the last arrival
            if not first:
                await asyncio.sleep(self.random.expovariate(level.rate))
                if expired():
                    break
            first = False
            task = asyncio.ensure_future(limited())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)


async def reference_outputs(
    backend: Backend,
    conversations: Sequence[Conversation],
    settings: RequestSettings,
    run_id: str,
) -> dict[tuple[int, int], tuple[int, ...]]:
    """Every turn of every conversation run alone (one at a time) at k = 0: the tokens each
    response under load must reproduce under greedy decoding (--check-exact)."""
    if not settings.greedy:
        raise ValueError("--check-exact needs greedy decoding (--temperature 0)")
    alone = Mode("k0", k=0, ssd=False)
    out: dict[tuple[int, int], tuple[int, ...]] = {}
    for conversation in conversations:
        session = None
        if len(conversation.turns) > 1:
            session = f"loadtest-{run_id}-reference-{conversation.index}"
        for t, text in enumerate(conversation.turns):
            record = RequestRecord("alone", alone.name, conversation.index, t)
            turn = settings.for_turn(conversation, t)
            await run_request(
                backend, record, text, alone, turn, settings.seed_for(conversation), session
            )
            if not record.ok:
                raise RuntimeError(
                    f"reference run of prompt {conversation.index} turn {t} at k=0 failed: "
                    f"{record.error}: {record.details}"
                )
            out[(conversation.index, t)] = record.tokens
    return out
