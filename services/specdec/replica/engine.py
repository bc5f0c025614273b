"""The replica engine's seam: what the drafter's and the verifier's servicers, and the jobs
they run on the model thread, need from the model engine.

One implementation: `ModelRuntime` (specdec.replica.runtime) over transformers, its
forwards batched across sessions by a `Scheduler` (specdec.replica.batching); the drafter's
`DrafterRuntime` is a ModelRuntime. Its sessions' KV is one of two stores, picked by
--engine: `CacheStore` (specdec.replica.kvstore, "dense": a DynamicCache per session) or
`PagedStore` (specdec.replica.paged, "paged": blocks of a per-layer pool, forks sharing
blocks copy-on-write). `run_replica` (specdec.replica.replica) is the one place that picks
the runtime; the servicers and the jobs are written against these protocols.

How a model call uses the engine. A servicer validates a request on the event loop
(`Engine.validate_tokens`, `validate_extent`, the model facts Info reports) and hands a
job to the model thread (`Engine.run`, or `Engine.submit` from the data plane): bounded by
--max-queue (`pending`; ReplicaBusy when full). The job, a generator, runs inside
`Engine.guarded(session_id)` and

- takes its session from the store (`SessionStore.acquire`): prefix lookup and reuse by
  (length, hash), CacheMiss when the session does not hold that prefix; a fork of another
  session's first tokens (`fork_from`); the capacity check (CapacityExceeded) and the LRU
  eviction of other sessions to make room;
- asks for forwards: `Engine.forward_steps` yields one `ForwardRequest` per chunk of the
  tokens it feeds and returns their last `keep` logits; SSD branches yield `BranchStep`s
  of a `BranchGroup` over the session (specdec.drafter.speculate). The scheduler batches
  the forwards of concurrent jobs of different sessions into one;
- rolls rejected tokens back (`SessionStore.truncate`) and fills in tokens it fed from the
  device once it has copied them to the host (`SessionStore.fill`).

`Engine.release` drops a session (Release); `SessionStore.cached_tokens`, `len()` and
`max_cached_tokens` are the cache's occupancy (Info, metrics).

Everything that touches a session runs on the model thread, so none of it takes locks.
Torch-free at import: torch's types are named only under TYPE_CHECKING.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch

    from specdec.common.config import ReplicaConfig
    from specdec.common.cost import Line, LoadWindow
    from specdec.common.metrics import ReplicaObserver
    from specdec.common.prefix import PrefixChain
    from specdec.replica.batching import ForwardRequest, Scheduler
    from specdec.replica.compiled import Compiled
    from specdec.replica.kvstore import Prefix
    from specdec.sdk.request import Sampling

T = TypeVar("T")


@runtime_checkable
class Session(Protocol):
    """One session's cached sequence (SessionCache): the tokens its KV covers, in order
    (a token fed from the device reads UNKNOWN_TOKEN until `SessionStore.fill`), and their
    chained prefix hashes. Jobs read them; the engine and its store change them."""

    tokens: list[int]
    chain: PrefixChain


S = TypeVar("S", bound=Session)


@runtime_checkable
class SessionStore(Protocol[S]):
    """The sessions' KV caches (CacheStore), bounded in cached tokens. Model thread only."""

    max_cached_tokens: int

    @property
    def cached_tokens(self) -> int:
        """Tokens cached over all sessions."""
        ...

    def __len__(self) -> int:
        """Sessions cached."""
        ...

    def acquire(
        self,
        session_id: str,
        prefix_len: int,
        prefix_hash_: int,
        grow_by: int,
        fork_from: str = "",
    ) -> S:
        """The session cropped to the prefix named by (prefix_len, prefix_hash_) with room
        for grow_by more tokens: a fresh one for prefix_len 0, CacheMiss when it holds other
        tokens, CapacityExceeded when prefix_len + grow_by exceeds max_cached_tokens; the
        least recently used other sessions are evicted to make room. fork_from: first make
        the session a copy of that session's first prefix_len tokens."""
        ...

    def truncate(self, session: S, length: int) -> None:
        """Roll the session back to its first `length` tokens (rejected drafts)."""
        ...

    def fill(self, session: S, tokens: Sequence[int]) -> None:
        """The values of the session's last len(tokens) tokens, fed from the device."""
        ...


@runtime_checkable
class Engine(Protocol[S]):
    """A replica's model engine: the loaded model, its sessions' caches and the model thread
    that runs every job and batches their forwards (ModelRuntime)."""

    # What it serves: the settings, and the model facts Info reports (set by `load`).
    config: ReplicaConfig
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]
    sampling_defaults: Sampling  # the model's generation_config (every field set)
    bos_token_id: int
    tokenizer_json: bytes  # zlib-compressed canonical JSON
    tokenizer_fingerprint: str
    chat_template: str
    special_tokens: dict[str, str]
    dtype_reason: str
    device: torch.device
    cost_lines: list[tuple[int, Line]]  # the forward cost curve as fitted now
    load_window: LoadWindow  # the forwards of the last seconds (reported with the curve)
    pending: int  # model requests submitted and not finished (--max-queue bounds them)
    obs: ReplicaObserver  # the replica's metrics and spans
    scheduler: Scheduler  # the model thread: the data plane serves on its selector (`io`)
    compiled: Compiled | None  # --compile: the compiled forwards (None: eager only)

    @property
    def store(self) -> SessionStore[S] | None:
        """The sessions' caches; None while the model loads."""
        ...

    @property
    def ready_store(self) -> SessionStore[S]:
        """The sessions' caches (NotReady while the model loads)."""
        ...

    @property
    def dtype_name(self) -> str: ...

    def load(self) -> None:
        """Load the model and make the store (blocking; on the model thread)."""
        ...

    def shutdown(self) -> None: ...

    # -- the event loop ------------------------------------------------------------------

    def validate_tokens(self, what: str, tokens: Sequence[int]) -> None:
        """InvalidRequest unless every id is in the vocabulary."""
        ...

    def validate_extent(self, prefix: Prefix, new_tokens: Sequence[int], extra: int) -> None:
        """InvalidRequest unless new_tokens is non-empty and in the vocabulary, and prefix +
        new_tokens + extra fits the model's context."""
        ...

    async def run(
        self, fn: Callable[..., T], *args: Any, bounded: bool = True, session: str | None = None
    ) -> T:
        """fn(*args) on the model thread, a job (a generator of forward requests) or a plain
        call; one at a time per `session`. bounded: a model request (counted in `pending`,
        ReplicaBusy beyond --max-queue); housekeeping passes False."""
        ...

    def submit(self, fn: Callable[..., T], *args: Any, session: str | None = None) -> Future:
        """`run` (bounded) without waiting: the job's future (any thread)."""
        ...

    # -- the model thread ----------------------------------------------------------------

    def guarded(self, session_id: str) -> AbstractContextManager[None]:
        """Around a job's work on its session: drop the session when the job fails after
        touching its cache (a cache miss, capacity or invalid request leave it)."""
        ...

    def forward_steps(
        self,
        session: S,
        tokens: Sequence[int] | torch.Tensor,
        keep: int | None = None,
        tree: Sequence[int] | None = None,
    ) -> Generator[ForwardRequest, torch.Tensor, torch.Tensor]:
        """A job's forwards feeding tokens (a list, or a device tensor [n]) after the
        session's cache: the logits of the last `keep` of them [keep, vocab] fp32 (all when
        None). tree: the parents of the last len(tree) tokens, a token tree (-1: the token
        before it), each scored after its ancestors only. `yield from` it in a job."""
        ...

    def release(self, session_id: str) -> bool:
        """Drop the session's cache; whether there was one."""
        ...


def arguments(call: Any) -> dict[str, Any]:
    """A typed call object's fields (a dataclass, e.g. DraftCall) as the keyword arguments
    of the function whose job it stands for: one name for each, no positional copy."""
    return {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}
