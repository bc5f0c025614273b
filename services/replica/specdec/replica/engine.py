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
- asks, where the request does (a Verify for a head drafter), for the target's features
  of the tokens it feeds (`Engine.feature_ask`, then a `FeatureSink` given to
  `forward_steps`: specdec.replica.features);
- rolls rejected tokens back (`SessionStore.truncate`), keeps a token tree's accepted path
  (`SessionStore.keep_path`) and fills in tokens it fed from the device once it has
  copied them to the host (`SessionStore.fill`).

What a store owns. Every operation on a session's KV is a method of its store: acquire
(prefix reuse, CacheMiss, the capacity bound, LRU eviction), fork, truncate (rollback),
keep_path, fill, release and held (eviction passes over a session a job works on). A job
names no store class and never touches a session's KV itself: it reads `Session.tokens`
and `chain` and calls these, so another store (another engine's) plugs in under the same
jobs. What the transformers engine's forwards need beyond that (the cache a batched
forward runs on, the write-back after it, whether one session's forward runs on its own
cache) is `TransformersStore`, which both of its stores implement.

`Engine.release` drops a session (Release); `SessionStore.cached_tokens`, `len()` and
`max_cached_tokens` are the cache's occupancy (Info, metrics).

Everything that touches a session runs on the model thread, so none of it takes locks.
Torch-free at import: torch's types are named only under TYPE_CHECKING.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    Protocol,
    TypeVar,
    overload,
    runtime_checkable,
)

if TYPE_CHECKING:
    import torch
    from transformers.cache_utils import Cache

    from specdec.common.cost import Line, LoadWindow
    from specdec.common.prefix import PrefixChain
    from specdec.replica.batching import ForwardRequest, Layout, Scheduler
    from specdec.replica.compiled import Compiled
    from specdec.replica.config import ReplicaConfig
    from specdec.replica.features import FeatureAsk, FeatureSink
    from specdec.replica.metrics import ReplicaObserver
    from specdec.sdk.request import Sampling

T = TypeVar("T")


@dataclass(frozen=True)
class Prefix:
    """The cached prefix a request builds on: its length and its chained hash
    (specdec.common.prefix.prefix_hash; PrefixRef on the wire)."""

    length: int
    hash: int


@runtime_checkable
class CachedSession(Protocol):
    """One session's cached sequence (SessionCache): the tokens its KV covers, in order
    (a token fed from the device reads UNKNOWN_TOKEN until `SessionStore.fill`), and their
    chained prefix hashes. Jobs read them; the engine and its store change them."""

    tokens: list[int]
    chain: PrefixChain


S = TypeVar("S", bound=CachedSession)


@runtime_checkable
class SessionStore(Protocol[S]):
    """The sessions' KV caches, bounded in cached tokens, and every operation on a session's
    KV: a job and a servicer change a session only through these, so a store is the whole
    of what an engine keeps per session (the dense `CacheStore`, the paged `PagedStore`).
    Model thread only."""

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
        the session a copy of that session's first prefix_len tokens (`fork`)."""
        ...

    def fork(self, source_id: str, session_id: str, length: int) -> S:
        """session_id becomes a copy of source_id's first `length` tokens and their KV
        (whatever it held is dropped); CacheMiss when the source does not hold them."""
        ...

    def truncate(self, session: S, length: int) -> None:
        """Roll the session back to its first `length` tokens (rejected drafts)."""
        ...

    def keep_path(self, session: S, base: int, path: Sequence[int]) -> None:
        """After a forward over a token tree (its nodes' KV at positions base.., in node
        order), keep only the accepted path: the KV and tokens of nodes path[0], path[1],
        ... moved to positions base, base + 1, ..., the rest rolled back, so the session
        ends holding base + len(path) tokens."""
        ...

    def fill(self, session: S, tokens: Sequence[int]) -> None:
        """The values of the session's last len(tokens) tokens, fed from the device."""
        ...

    def release(self, session_id: str) -> bool:
        """Drop the session and its KV; whether there was one."""
        ...

    def held(self, session_id: str) -> AbstractContextManager[None]:
        """Around a job's work on its session: eviction may pass over it meanwhile."""
        ...


@runtime_checkable
class TransformersStore(SessionStore[S], Protocol[S]):
    """A store of the transformers engine (ModelRuntime): also what its forwards need of
    the sessions' KV. A batched forward runs the model over a transformers ``Cache`` the
    store makes for the batch's `Layout` (specdec.replica.batching), and the store takes
    the rows' new keys/values back after it."""

    # Whether a forward of one session's request alone runs the model's plain forward on
    # the session's own cache (`session.kv`, which the model updates in place): the dense
    # store's fast path, no layout, no copy. Otherwise even one row goes through
    # `batch_cache`.
    own_cache_forward: bool

    def batch_cache(self, layout: Layout, model_config: Any) -> Cache:
        """The cache the model's forward over `layout`'s rows runs on (model_config: the
        model's transformers config)."""
        ...

    def after_batch(self, cache: Cache, layout: Layout) -> None:
        """After that forward: the rows' new keys/values and tokens are their sessions'
        (a branch row's, its group's)."""
        ...

    def kv_footprint(self) -> dict[str, int]:
        """What the sessions' KV holds now: `kv_bytes` (the resident keys/values), and
        what else the store counts (the paged store's blocks)."""
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
    engine_reason: str  # why --engine auto chose this engine ("" when it was named)
    device: torch.device
    cost_lines: list[tuple[int, Line]]  # the forward cost curve as fitted now
    RAGGED: ClassVar[bool]  # forwards without pads: cost_lines is one line over their tokens
    cost_points: list[tuple[float, float, float]]  # RAGGED: (tokens, ms, forwards) measured
    load_window: LoadWindow  # the forwards of the last seconds (reported with the curve)
    pending: int  # model requests submitted and not finished (--max-queue bounds them)
    obs: ReplicaObserver  # the replica's metrics and spans
    scheduler: Scheduler  # the model thread: the data plane serves on its selector (`io`)
    compiled: Compiled | None  # --compile: the compiled forwards (None: eager only)
    # A head drafter (specdec.drafter.head): the target's features it drafts from
    # (ModelInfo.features); None for every other engine.
    head_features: FeatureAsk | None

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

    def feature_ask(self, msg: Any) -> FeatureAsk:
        """A request's common_pb2.FeatureRequest, validated for this model: InvalidRequest
        for layers outside its decoder layers or an unknown format; FailedPrecondition (or
        Unimplemented) where the engine cannot read its hidden states."""
        ...

    @overload
    async def run(
        self,
        fn: Callable[..., Generator[Any, Any, T]],
        *args: Any,
        bounded: bool = True,
        session: str | None = None,
    ) -> T: ...

    @overload
    async def run(
        self, fn: Callable[..., T], *args: Any, bounded: bool = True, session: str | None = None
    ) -> T: ...

    async def run(
        self, fn: Callable[..., Any], *args: Any, bounded: bool = True, session: str | None = None
    ) -> Any:
        """fn(*args) on the model thread (a job's result: its return value), a job (a generator of forward requests) or a plain
        call; one at a time per `session`. bounded: a model request (counted in `pending`,
        ReplicaBusy beyond --max-queue); housekeeping passes False."""
        ...

    def submit(self, fn: Callable[..., T], *args: Any, session: str | None = None) -> Future[Any]:
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
        features: FeatureSink | None = None,
        inputs: torch.Tensor | None = None,
    ) -> Generator[ForwardRequest, torch.Tensor, torch.Tensor]:
        """A job's forwards feeding tokens (a list, or a device tensor [n]) after the
        session's cache: the logits of the last `keep` of them [keep, vocab] fp32 (all when
        None). tree: the parents of the last len(tree) tokens, a token tree (-1: the token
        before it), each scored after its ancestors only. features: the sink that gets
        every fed token's features, in order (after `feature_ask`). inputs [n, width]:
        each token's input feature, for an engine over a draft head
        (specdec.drafter.head); None for a model. `yield from` it in a job."""
        ...

    def release(self, session_id: str) -> bool:
        """Drop the session's cache; whether there was one."""
        ...
