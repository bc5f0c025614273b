"""Per-session KV caches of a replica and the tokens each covers.

The dense engine's store: a session's cache is a transformers ``DynamicCache`` with the
tokens it holds; rollback of rejected draft tokens is a crop, a cache miss a dict lookup,
eviction dropping one object, a fork a deep copy, keeping a token tree's accepted path a
gather of its slots. `CacheStore` bounds the tokens cached over all sessions (least
recently used go first) and implements every operation on a session
(specdec.replica.engine.SessionStore), and what a forward needs of the sessions' KV
(`TransformersStore`: the batch's cache, the write-back after it). The paged engine's
store (specdec.replica.paged.PagedStore) keeps all of that and overrides the KV
operations (`_new_session`, `_copy`, `_crop`, `_drop`, `_gather`) and the batch's cache
with block operations. Everything here runs on the replica's model thread
(specdec.replica.runtime), so it needs no locks.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdec.common.errors import CACHE_MISS_PREFIX, CacheMiss, CapacityExceeded
from specdec.common.prefix import PrefixChain
from specdec.replica.metrics import note_cache, note_eviction, note_fork, note_rollback

if TYPE_CHECKING:
    from transformers.cache_utils import Cache

    from specdec.replica.batching import Layout

log = logging.getLogger(__name__)

# What SessionCache.tokens holds for a token fed from the device (a draft token still on
# the device) until its job copies it to the host and fills it in (CacheStore.fill).
UNKNOWN_TOKEN = -1


@dataclass
class SessionCache:
    """KV cache of one session and the tokens it covers (len(tokens) == cache length)."""

    tokens: list[int]
    kv: Any  # transformers DynamicCache (None in the paged engine: its blocks hold the KV)
    last_used: float = field(default_factory=time.monotonic)
    # Block hashes of tokens' prefixes (cropped with tokens): prefix checks cost O(new).
    chain: PrefixChain = field(default_factory=PrefixChain)

    def append(self, tokens: Sequence[int] | torch.Tensor) -> None:
        """The tokens a forward fed (a list, or a device tensor [n] whose values its job
        fills in once it copies them to the host)."""
        if isinstance(tokens, torch.Tensor):
            self.tokens.extend([UNKNOWN_TOKEN] * tokens.numel())
        else:
            self.tokens.extend(tokens)


class CacheStore:
    """Per-session KV caches with a bound on total cached tokens and LRU eviction.

    Only ever used from the runtime's executor thread.
    """

    # A session's request alone runs on its own DynamicCache (TransformersStore).
    own_cache_forward = True

    def __init__(self, max_cached_tokens: int, new_cache: Callable[[], object] | None = None):
        self.max_cached_tokens = max_cached_tokens
        self._new_cache = new_cache
        self._sessions: OrderedDict[str, SessionCache] = OrderedDict()
        self._held: Counter[str] = Counter()  # sessions a job works on (`held`)

    @property
    def cached_tokens(self) -> int:
        return sum(len(s.tokens) for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def tokens(self, session_id: str) -> list[int] | None:
        s = self._sessions.get(session_id)
        return None if s is None else list(s.tokens)

    def acquire(
        self,
        session_id: str,
        prefix_len: int,
        prefix_hash_: int,
        grow_by: int,
        fork_from: str = "",
    ) -> SessionCache:
        """The session's cache cropped to the named prefix, with room for grow_by more tokens.

        Raises CacheMiss when the cache does not start with that prefix (a fresh cache is
        made for prefix_len 0), CapacityExceeded when prefix_len + grow_by exceeds the bound.
        fork_from: first replace the session's cache by a copy of that session's first
        prefix_len tokens (`fork`); ignored when prefix_len is 0.
        """
        need = prefix_len + grow_by
        if need > self.max_cached_tokens:
            raise CapacityExceeded(
                f"session needs {need} cached tokens, this replica holds at most "
                f"{self.max_cached_tokens} (--max-cached-tokens)"
            )
        if fork_from and prefix_len and fork_from != session_id:
            self.fork(fork_from, session_id, prefix_len)
        session = self._sessions.get(session_id)
        if prefix_len == 0:
            if session is None or session.tokens:
                if session is not None:
                    self._drop(session)
                session = self._new_session()
                self._sessions[session_id] = session
        else:
            session = _holding(session, f"session {session_id!r}", prefix_len)
            if session.chain.hash(session.tokens, prefix_len) != prefix_hash_:
                raise CacheMiss(
                    f"{CACHE_MISS_PREFIX}: session {session_id!r} holds different tokens in its "
                    f"first {prefix_len}"
                )
            self.truncate(session, prefix_len)
        note_cache(prefix_len)
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        self._make_room(session_id, need)
        return session

    def fork(self, source_id: str, session_id: str, length: int) -> SessionCache:
        """session_id becomes a copy of source_id's first `length` tokens and their KV (the
        n choices of one prompt share its prefill; each then grows its own copy). Whatever
        session_id held is dropped. CacheMiss when the source is not cached or is shorter;
        the caller's prefix check then proves the copy holds the tokens it names."""
        source = _holding(self._sessions.get(source_id), f"fork source {source_id!r}", length)
        # The tokens after `length` may still be in flight in the source's own job (device
        # tokens not filled in yet): only the first `length` are taken, and a forward never
        # runs half-way here (one model thread), so their KV is complete.
        forked = self._copy(source, length)
        old = self._sessions.get(session_id)
        if old is not None:
            self._drop(old)
        self._sessions[session_id] = forked
        self._sessions.move_to_end(session_id)
        note_fork(length)
        return forked

    def fill(self, session: SessionCache, tokens: Sequence[int]) -> None:
        """The values of the last len(tokens) tokens, fed from the device (SessionCache.append)."""
        if tokens:
            tail = session.tokens[-len(tokens) :]
            assert all(t == UNKNOWN_TOKEN for t in tail), "fill: those tokens are known"
            session.tokens[-len(tokens) :] = tokens

    def truncate(self, session: SessionCache, length: int) -> None:
        """Roll the session back to its first `length` tokens."""
        drop = len(session.tokens) - length
        if drop > 0:
            self._crop(session, length)
            del session.tokens[length:]
            session.chain.crop(length)
            note_rollback(drop)

    @torch.inference_mode()
    def keep_path(self, session: SessionCache, base: int, path: Sequence[int]) -> None:
        """After a tree forward (the nodes' slots from `base` on, in node order), keep only
        the accepted path: its nodes' keys/values and tokens gathered to slots base..
        base + len(path) (`_gather`), the rest rolled back (`truncate`)."""
        if path and list(path) != list(range(len(path))):
            sources = [base + i for i in path]
            self._gather(session, sources, base)
            session.tokens[base : base + len(path)] = [session.tokens[i] for i in sources]
        self.truncate(session, base + len(path))

    def release(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._drop(session)
        return True

    @contextmanager
    def held(self, session_id: str) -> Iterator[None]:
        """Around a job's work on its session (ModelRuntime.guarded): the session is in use."""
        self._held[session_id] += 1
        try:
            yield
        finally:
            self._held[session_id] -= 1
            if not self._held[session_id]:
                del self._held[session_id]

    def _evictable(self, session_id: str) -> bool:
        """Whether eviction may drop the session. The dense engine evicts a session in use
        too: its job keeps the DynamicCache object, and its next request misses."""
        return True

    # -- the KV operations (the dense engine's; PagedStore overrides them) --------------

    def _new_session(self) -> SessionCache:
        """An empty session."""
        if self._new_cache is None:
            raise TypeError("a CacheStore without new_cache cannot make a session's KV")
        return SessionCache(tokens=[], kv=self._new_cache())

    def _copy(self, source: SessionCache, length: int) -> SessionCache:
        """A new session holding source's first `length` tokens and their KV: a deep copy."""
        kv = copy.deepcopy(source.kv)
        drop = len(source.tokens) - length
        if drop:
            kv.crop(-drop)
        return SessionCache(tokens=source.tokens[:length], kv=kv)

    def _crop(self, session: SessionCache, length: int) -> None:
        """Drop the KV of the session's tokens after its first `length`."""
        session.kv.crop(length - len(session.tokens))

    def _drop(self, session: SessionCache) -> None:
        """The session leaves the store (released, evicted or replaced): nothing to free
        here, its DynamicCache goes with it."""

    def _gather(self, session: SessionCache, sources: list[int], base: int) -> None:
        """The KV of the session's positions `sources` copied to positions base,
        base + 1, ... (in every layer; sources are all >= base)."""
        src = torch.tensor(sources, dtype=torch.long)
        dst = torch.arange(base, base + len(sources), device=session.kv.layers[0].keys.device)
        for layer in session.kv.layers:
            index = src.to(layer.keys.device)
            layer.keys[:, :, dst] = layer.keys[:, :, index]
            layer.values[:, :, dst] = layer.values[:, :, index]

    # -- what a forward needs (TransformersStore; PagedStore overrides them) -------------

    def batch_cache(self, layout: Layout, model_config: Any) -> Cache:
        """A padded copy of the rows' caches (Layout.cache)."""
        cache: Cache = layout.cache(model_config)
        return cache

    def after_batch(self, cache: Cache, layout: Layout) -> None:
        """Each row's new slots appended to its session's cache (Layout.write_back)."""
        layout.write_back(cache)

    def kv_footprint(self) -> dict[str, int]:
        """The bytes of the sessions' DynamicCaches' keys and values."""
        kv_bytes = sum(
            layer.keys.nbytes + layer.values.nbytes
            for session in self._sessions.values()
            for layer in session.kv.layers
            if layer.keys is not None and layer.values is not None
        )
        return {"kv_bytes": kv_bytes}

    def _make_room(self, keep: str, need: int) -> None:
        """Evict least recently used sessions (never `keep`) until `need` more tokens fit."""
        total = self.cached_tokens - len(self._sessions[keep].tokens) + need
        while total > self.max_cached_tokens:
            victim_id = next((v for v in self._sessions if v != keep and self._evictable(v)), None)
            if victim_id is None:  # only `keep` (and held sessions) left: rare
                break
            victim = self._sessions.pop(victim_id)
            self._drop(victim)
            total -= len(victim.tokens)
            note_eviction(len(victim.tokens))
            log.info(
                "evicted session cache",
                extra={"session_id": victim_id, "tokens": len(victim.tokens)},
            )


def _holding(session: SessionCache | None, what: str, length: int) -> SessionCache:
    """The session if it holds at least `length` tokens, else CacheMiss naming `what`."""
    if session is None:
        raise CacheMiss(f"{CACHE_MISS_PREFIX}: {what} is not cached here")
    if len(session.tokens) < length:
        raise CacheMiss(
            f"{CACHE_MISS_PREFIX}: {what} holds {len(session.tokens)} tokens, request builds "
            f"on {length}"
        )
    return session
