"""The paged engine's KV: sessions' keys/values in fixed-size blocks of one pool per layer.

Selected with --engine paged (the dense engine, --engine dense, keeps a transformers
``DynamicCache`` per session: specdec.replica.kvstore). Everything here runs on the model
thread, like the store it replaces.

The pool. Every layer has one key tensor and one value tensor of [kv heads, slots, head
dim]; slot s belongs to block s // block_size (--kv-block-size tokens). A session holds a
*block table* (`PagedSession.blocks`): token position p is slot blocks[p // bs] * bs + p % bs.
Block 0 is the null block: never handed out, all zeros; the padding of a batched forward
reads it. Blocks are reference-counted (`BlockPool`): a session's table holds one reference
on each of its blocks.

The block operations (`PagedStore`, the CacheStore of this engine):

- a new session: an empty table;
- rollback (rejected drafts, a shorter prefix): drop the table's blocks past the kept
  length (their reference; a block no table holds is free again); nothing is copied;
- fork (n choices of one prompt, a branch group's session): the new table references the
  source's blocks of its first `length` tokens: nothing is copied then. A block is written
  only at a session's next position, so only a session's last, partial block can be
  written while another table holds it: the writer then copies that block first (copy on
  write: its first p % bs slots, once, per layer);
- prefix reuse: the session's table already holds the prefix (a rollback to it);
- eviction and release: drop the table's references. Eviction passes over a session a job
  is working on (`CacheStore.held`), whose blocks its forwards still read and write;
- a token tree's accepted path (`keep_path`): its nodes' slots gathered to follow the
  tokens before the tree, within the session's own blocks (the tree's forward wrote
  them, so no other table shares them), then a rollback.

The forward (`PagedForward`, a transformers ``Cache`` whose layers are `PagedLayer`s). The
batch is laid out as the dense engine's (specdec.replica.batching.Layout: R rows, each
row's cached slots left-padded to L, inputs right-padded to N, the same attention mask and
positions). Before the forward, each session row gets slots for its new tokens (blocks
allocated, a shared last block copied). In every layer the model's attention calls
`PagedLayer.update` (`PagedForward.write_and_gather`) with the new keys/values [R, heads, N, dim]:

1. they are written into the pool at the rows' new slots (a right pad is not written),
   once: there is no write-back after the forward;
2. the keys and values the rows attend to are gathered from the pool into one buffer
   [R, heads, L + N, dim] by one index per row (a left or right pad reads the null block;
   a branch row's own fed tokens, kept in its BranchGroup as in the dense engine, and its
   new token are copied in after the gather), and handed to the model's own attention.

What is copied, and when: that gather, one layer at a time, into a buffer the next layer
reuses, so the transient memory of a forward is one layer's [R, heads, L + N, dim] keys and
values (the dense engine builds every layer's padded copy before the forward, and writes
each row's new slots back to its DynamicCache after it, which is itself a concatenation of
the session's whole cache per forward). The pool grows by doubling when no block is free
(one copy of the pool, rare). A fork copies nothing until its shared last block is
written, then that block.

Exactness. The buffer a layer attends to holds the same values as the dense engine's
padded cache (the pads read zeros in both), under the same mask and positions, so the
model's attention computes the same thing; the integration tests check greedy output
equals ``generate()`` token for token with either engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specdec.replica.batching import BranchStep, Layout
from specdec.replica.kvstore import CacheStore, SessionCache

log = logging.getLogger(__name__)

NULL_BLOCK = 0  # all zeros, never handed out: what a pad reads


class BlockPool:
    """Blocks of block_size slots in per-layer key/value tensors [heads, slots, dim],
    reference-counted. The tensors are made at the first write (the model's heads, head
    dim, dtype and device) for `blocks` blocks (the store's token bound: memory the OS
    commits only as slots are written), and doubled whenever none is free (a copy)."""

    def __init__(self, layers: int, block_size: int, blocks: int = 64):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.layers = layers
        self.block_size = block_size
        self.refs: list[int] = [0] * max(2, blocks)  # per block; block 0 (null) never counted
        self._free: list[int] = list(range(len(self.refs) - 1, NULL_BLOCK, -1))
        self.keys: list[torch.Tensor | None] = [None] * layers  # [heads, slots, dim]
        self.values: list[torch.Tensor | None] = [None] * layers

    @property
    def blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        return len(self.refs)

    @property
    def used(self) -> int:
        """Blocks some table references."""
        return self.blocks - 1 - len(self._free)

    def allocate(self) -> int:
        """A free block, referenced once (the pool doubles when none is free)."""
        if not self._free:
            self._grow(2 * self.blocks)
        block = self._free.pop()
        self.refs[block] = 1
        return block

    def incref(self, block: int) -> None:
        self.refs[block] += 1

    def decref(self, block: int) -> None:
        self.refs[block] -= 1
        assert self.refs[block] >= 0, f"block {block} released twice"
        if self.refs[block] == 0:
            self._free.append(block)

    def copy(self, source: int, target: int, slots: int) -> None:
        """The first `slots` slots of block source into block target, in every layer."""
        if not slots:
            return
        bs = self.block_size
        src, dst = slice(source * bs, source * bs + slots), slice(target * bs, target * bs + slots)
        for keys, values in zip(self.keys, self.values, strict=True):
            if keys is not None and values is not None:
                keys[:, dst] = keys[:, src]
                values[:, dst] = values[:, src]

    def nbytes(self) -> int:
        """Bytes of the pool's tensors (all layers, keys and values)."""
        return sum(
            t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None
        )

    def tensors(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (keys, values) pool, made like `like` [rows, heads, n, dim] at the
        first write."""
        if self.keys[layer] is None:
            _, heads, _, dim = like.shape
            slots = self.blocks * self.block_size
            for tensors in (self.keys, self.values):
                # Uninitialised: only the null block is read before it is written, and
                # the memory of a slot becomes resident when first written.
                pool = like.new_empty(heads, slots, dim)
                pool[:, : self.block_size] = 0
                tensors[layer] = pool
        keys, values = self.keys[layer], self.values[layer]
        assert keys is not None and values is not None
        return keys, values

    def _grow(self, blocks: int) -> None:
        old = self.blocks
        self.refs.extend([0] * (blocks - old))
        self._free.extend(range(blocks - 1, old - 1, -1))
        slots = blocks * self.block_size
        for tensors in (self.keys, self.values):
            for layer, pool in enumerate(tensors):
                if pool is not None:
                    tensors[layer] = _extended(pool, slots)
        log.info("KV block pool grown", extra={"blocks": blocks, "block_size": self.block_size})


def _extended(pool: torch.Tensor, slots: int) -> torch.Tensor:
    grown = pool.new_empty(pool.shape[0], slots, pool.shape[2])
    grown[:, : pool.shape[1]] = pool
    return grown


@dataclass
class PagedSession(SessionCache):
    """A session of the paged engine: its tokens and its block table (no DynamicCache)."""

    kv: object = None
    blocks: list[int] = field(default_factory=list)


class PagedStore(CacheStore):
    """CacheStore's sessions, bound and eviction, over a BlockPool (see the module
    docstring): fork shares blocks, rollback and eviction drop references, a batched
    forward reads and writes the blocks in place (`PagedForward`)."""

    # Even one session's forward reads its KV from the pool: through `batch_cache`.
    own_cache_forward = False

    def __init__(self, max_cached_tokens: int, pool: BlockPool):
        super().__init__(max_cached_tokens)
        self.pool = pool

    def _evictable(self, session_id: str) -> bool:
        """Not a session a job works on: its blocks would go back to the pool under it."""
        return session_id not in self._held

    def _new_session(self) -> PagedSession:
        return PagedSession(tokens=[])

    def _copy(self, source: SessionCache, length: int) -> PagedSession:
        assert isinstance(source, PagedSession)
        blocks = source.blocks[: -(-length // self.pool.block_size)]
        for block in blocks:
            self.pool.incref(block)
        return PagedSession(tokens=source.tokens[:length], blocks=blocks)

    def _crop(self, session: SessionCache, length: int) -> None:
        assert isinstance(session, PagedSession)
        keep = -(-length // self.pool.block_size)
        for block in session.blocks[keep:]:
            self.pool.decref(block)
        del session.blocks[keep:]

    def _drop(self, session: SessionCache) -> None:
        self._crop(session, 0)

    def _gather(self, session: SessionCache, sources: list[int], base: int) -> None:
        assert isinstance(session, PagedSession)
        slots = self.slots(session, max(sources) + 1)
        src, dst = slots[sources], slots[base : base + len(sources)]
        for keys, values in zip(self.pool.keys, self.pool.values, strict=True):
            if keys is not None and values is not None:
                index, to = src.to(keys.device), dst.to(keys.device)
                keys[:, to] = keys[:, index]
                values[:, to] = values[:, index]

    def batch_cache(self, layout: Layout, model_config: Any) -> PagedForward:
        """The rows' blocks, read and written in place (`PagedForward`)."""
        return PagedForward(self, layout, self.pool.layers)

    def after_batch(self, cache: Cache, layout: Layout) -> None:
        assert isinstance(cache, PagedForward)  # this store's batch_cache
        cache.finish()

    def kv_footprint(self) -> dict[str, int]:
        """The pool's bytes (every block, used or free), and its blocks in use."""
        return {
            "kv_bytes": self.pool.nbytes(),
            "blocks_used": self.pool.used,
            "blocks": self.pool.blocks,
        }

    def slots(self, session: PagedSession, length: int) -> torch.Tensor:
        """The pool slots of the session's first `length` positions [length] (its table
        must cover them)."""
        bs = self.pool.block_size
        table = torch.tensor(session.blocks, dtype=torch.long)
        return (table[:, None] * bs + torch.arange(bs)).flatten()[:length]

    def reserve(self, session: PagedSession, n: int) -> None:
        """Blocks for the session's next n positions: new blocks past its table, and a
        private copy of its last block when another table shares it (copy on write)."""
        bs, start = self.pool.block_size, len(session.tokens)
        if n <= 0:
            return
        if start % bs and self.pool.refs[last := session.blocks[-1]] > 1:
            own = self.pool.allocate()
            self.pool.copy(last, own, start % bs)
            self.pool.decref(last)
            session.blocks[-1] = own
        while len(session.blocks) * bs < start + n:
            session.blocks.append(self.pool.allocate())


class PagedLayer(CacheLayerMixin):
    """One layer of a PagedForward: the model's attention hands it the new keys/values and
    attends to what it returns (see the module docstring)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, forward: PagedForward, index: int):
        CacheLayerMixin.__init__(self)  # by name: its __init__ has no annotations
        self.forward = forward
        self.index = index
        self.is_initialized = True

    def lazy_initialization(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> None:  # never lazy
        pass

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward.write_and_gather(self.index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.forward.width + query_length, 0

    def get_seq_length(self) -> int:
        return self.forward.width

    def get_max_length(self) -> int:
        return -1


class PagedForward(Cache):
    """The cache a batched forward of the paged engine runs on: reads the rows' blocks in
    the pool, writes their new slots there (see the module docstring)."""

    def __init__(self, store: PagedStore, layout: Layout, layers: int):
        super().__init__(layers=[PagedLayer(self, i) for i in range(layers)])
        self.store = store
        self.pool = store.pool
        self.layout = layout
        self.width = layout.width  # L
        rows, longest = layout.rows, layout.longest
        total = self.width + longest
        gather = torch.full((rows, total), NULL_BLOCK, dtype=torch.long)  # null slot 0
        write_rows: list[int] = []  # flat [R * N] index of each new token written
        write_slots: list[torch.Tensor] = []
        self.branches: list[tuple[slice, int, Any]] = []  # (rows, fed, group)
        for r, start, cached in zip(layout.requests, layout.starts, layout.cached, strict=True):
            length = len(r.session.tokens)
            pad = self.width - cached
            if isinstance(r, BranchStep):
                rows_ = slice(start, start + r.rows)
                if length:
                    gather[rows_, pad : pad + length] = store.slots(r.session, length)
                self.branches.append((rows_, r.group.fed, r.group))
            else:
                n = len(r.tokens)
                store.reserve(r.session, n)
                slots = store.slots(r.session, length + n)
                gather[start, pad : self.width + n] = slots
                write_rows.extend(range(start * longest, start * longest + n))
                write_slots.append(slots[length:])
        self.gather = gather.flatten()
        self.write_rows = torch.tensor(write_rows, dtype=torch.long)
        self.write_slots = torch.cat(write_slots) if write_slots else None
        self.dense_writes = len(write_rows) == rows * longest  # every row fed N real tokens
        self._buffer: tuple[torch.Tensor, torch.Tensor] | None = None

    def write_and_gather(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values [R, heads, N, dim] of the batch's inputs: write the session rows'
        into the pool, gather what each row attends to [R, heads, L + N, dim]."""
        pool_keys, pool_values = self.pool.tensors(layer, keys)
        device = keys.device
        if self.write_slots is not None:
            slots = self.write_slots.to(device)
            for pool, new in ((pool_keys, keys), (pool_values, values)):
                flat = new.transpose(1, 2).reshape(-1, new.shape[1], new.shape[3])  # [R*N, h, d]
                if not self.dense_writes:
                    flat = flat.index_select(0, self.write_rows.to(device))
                pool.index_copy_(1, slots, flat.transpose(0, 1))
        rows, heads, longest, dim = keys.shape
        total = self.width + longest
        if self._buffer is None:  # one buffer for every layer: a layer is done with it
            shape = (heads, rows * total, dim)
            self._buffer = (keys.new_empty(shape), values.new_empty(shape))
            self.gather = self.gather.to(device)
        out = []
        pairs = ((pool_keys, self._buffer[0], keys), (pool_values, self._buffer[1], values))
        for pool, buffer, new in pairs:
            torch.index_select(pool, 1, self.gather, out=buffer)
            view = buffer.view(heads, rows, total, dim).transpose(0, 1)  # [R, heads, L + N, dim]
            for rows_, fed, group in self.branches:
                if fed:
                    own = (group.keys if new is keys else group.values)[layer]
                    view[rows_, :, self.width - fed : self.width] = own
                view[rows_, :, self.width :] = new[rows_]
            out.append(view)
        self._write_branches(layer, keys, values)
        return out[0], out[1]

    def _write_branches(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A branch row's new key/value: appended to its group's own (as the dense engine)."""
        for rows_, fed, group in self.branches:
            new_keys, new_values = keys[rows_, :, :1], values[rows_, :, :1]
            if fed:
                group.keys[layer] = torch.cat([group.keys[layer], new_keys], dim=2)
                group.values[layer] = torch.cat([group.values[layer], new_values], dim=2)
            else:
                group.keys.append(new_keys.clone())
                group.values.append(new_values.clone())

    def finish(self) -> None:
        """After the forward: the sessions' tokens and the groups' fed counts."""
        for r in self.layout.requests:
            if isinstance(r, BranchStep):
                r.group.fed += 1
            else:
                r.session.append(r.tokens)
