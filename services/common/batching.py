"""Batching across sessions: the model thread's scheduler loop and the padded batch forward.

Why this mechanism. Each session keeps its own transformers ``DynamicCache`` (rollback is a
crop, a miss is a dict lookup, eviction drops one object: none of that changes). A forward
over several sessions gathers their caches into one *padded* batch for the duration of that
forward and writes each row's new key/value slice back to its own cache afterwards. A
block-based (paged) cache would avoid the copy, but needs attention kernels that read
blocks, which plain ``transformers`` on CPU does not have; the padded batch uses the model's
own forward unchanged.

How a forward of B sessions is laid out (cache lengths l_i, inputs of n_i tokens,
L = max l_i, N = max n_i):

- keys/values of every layer: [B, heads, L, dim], row i left-padded with zeros to L (its
  l_i cached slots at the end);
- input_ids [B, N]: row i's tokens, right-padded (pad id 0);
- attention_mask [B, L + N]: 1 on row i's cached slots and on its n_i real inputs, 0 on the
  left pads and the right pads. The model's causal mask then lets a real query see exactly
  its own cache and the inputs before it (a right pad comes after every real input, so no
  real query sees it; every query sees at least itself, so no row is fully masked);
- position_ids [B, N]: l_i + j for input j of row i (the true position, as unbatched);
- after the forward, row i's new keys/values are slots [L, L + n_i) of the batch cache,
  appended to its session's cache; its logits are the last `keep` of its real inputs,
  computed through the output head only for those rows.

A masked slot gets zero attention weight, so a row's result equals its unbatched forward up
to floating-point reduction order (tests/unit/test_batching.py checks fp32 tolerance;
the integration tests check greedy output equals ``generate()`` token for token).

Memory cost: during a batched forward the padded copy of the batch's KV, B x (L + N) slots
per layer (keys and values), exists next to the sessions' own caches, and the model's
concatenation of the new slots briefly doubles one layer of it. For the Qwen2.5-Coder 1.5B
target in bfloat16 (28 layers, 2 KV heads of 128) a slot costs 28 KB: 8 sessions at 2,048
tokens is about 460 MB, freed when the forward returns. A batch of one runs today's
unbatched forward on the session's own cache: no copy.

The scheduler. The model thread runs one loop. A model call (Draft, Verify, Speculate,
Info, ...) is a *job*: a generator that validates and acquires its session's cache on the
model thread, then yields a `ForwardRequest` for every forward it needs and receives that
forward's logits (a plain function is a job without forwards). Whenever the model is free,
the loop admits waiting jobs (oldest first, up to --max-batch-size in flight, one job per
session at a time so a session's jobs never interleave), runs each to its next forward
request, and runs one forward over the pending requests that fit --max-batch-size rows and
--max-batch-tokens padded tokens (rows x longest input), oldest first, skipping a request
that would make padding more than half the forward (short steps and long prefill chunks
run in separate forwards). Nothing waits for a
batch to fill: an idle model runs whatever is pending, alone if it is alone (continuous
batching, no timer). A Draft's k steps are k successive requests, so the drafting sessions
step in lock-step and leave the batch when done; a job that fails (cache miss, capacity,
bad input) fails alone, before it joins a forward. A forward that raises fails the jobs in
it (each drops its session cache, as unbatched). --max-batch-size 1 runs one job at a time
to completion: the behaviour before batching.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)


@dataclass
class ForwardRequest:
    """One session's share of a forward: feed `tokens` after its cache, return the logits
    of the last `keep` of them [keep, vocab] fp32."""

    session: Any  # specdec.common.runtime.SessionCache
    tokens: list[int]
    keep: int
    fresh: bool  # part of a prefill (metrics)


# A job yields ForwardRequests, receives their logits, and returns its result.
Job = Generator[ForwardRequest, torch.Tensor, Any]


@dataclass
class _Task:
    seq: int
    start: Callable[[], Any]  # returns a Job (or the result itself: a plain call)
    key: str | None  # session id: one task per key in flight
    context: contextvars.Context
    future: Future = field(default_factory=Future)
    job: Job | None = None
    request: ForwardRequest | None = None


class Scheduler:
    """The model thread: admits jobs, batches their forwards (see the module docstring).

    run_batch(requests) runs one forward over the requests (a list of one: unbatched) and
    returns each one's logits; it is called in the context of the batch's oldest job.
    note_member(request, batch) is called in the context of every other job of a batch.
    """

    def __init__(
        self,
        name: str,
        max_batch_size: int,
        max_batch_tokens: int,
        run_batch: Callable[[list[ForwardRequest]], list[torch.Tensor]] | None = None,
        note_member: Callable[[ForwardRequest, int], None] | None = None,
    ):
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.run_batch = run_batch
        self.note_member = note_member
        self._cond = threading.Condition()
        self._waiting: deque[_Task] = deque()
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------

    def submit(
        self,
        start: Callable[[], Any],
        key: str | None = None,
        context: contextvars.Context | None = None,
    ) -> Future:
        """Queue a job: start() runs on the model thread in `context` (a copy of the
        caller's when None) and returns a Job generator or a plain result."""
        task = _Task(next(self._seq), start, key, context or contextvars.copy_context())
        with self._cond:
            if self._stopped:
                raise RuntimeError("the model thread is shut down")
            self._waiting.append(task)
            self._cond.notify()
        return task.future

    def shutdown(self) -> None:
        """Stop the loop; jobs not started are cancelled (the running forward finishes)."""
        with self._cond:
            self._stopped = True
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify()
        for task in waiting:
            task.future.cancel()

    # -- the model thread ---------------------------------------------------------------

    def _loop(self) -> None:
        active: list[_Task] = []  # started jobs waiting for a forward, oldest first
        while True:
            with self._cond:
                while not self._waiting and not active and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    break
            self._admit(active)
            if not active:
                continue
            batch = self._select(active)
            requests = [t.request for t in batch]
            try:
                results = batch[0].context.run(self._run, requests)
                error = None
            except BaseException as e:  # the jobs in this forward get the error
                results, error = [None] * len(batch), e
            for task, result in zip(batch, results, strict=True):
                active.remove(task)
                if error is None and task is not batch[0] and self.note_member is not None:
                    task.context.run(self.note_member, task.request, len(batch))
                if self._step(task, result, error):
                    active.append(task)
            active.sort(key=lambda t: t.seq)
        for task in active:
            task.future.set_exception(RuntimeError("the model thread was shut down"))
            task.job.close()

    def _run(self, requests: list[ForwardRequest]) -> list[torch.Tensor]:
        if self.run_batch is None:
            raise RuntimeError("this scheduler has no model to run forwards on")
        return self.run_batch(requests)

    def _admit(self, active: list[_Task]) -> None:
        """Start waiting jobs, oldest first, while fewer than max_batch_size are in flight;
        a job whose session already has one in flight waits for it."""
        while len(active) < self.max_batch_size:
            with self._cond:
                busy = {t.key for t in active if t.key is not None}
                task = next((t for t in self._waiting if t.key is None or t.key not in busy), None)
                if task is None:
                    return
                self._waiting.remove(task)
            if not task.future.set_running_or_notify_cancel():
                continue  # its caller gave up before it started
            try:
                started = task.context.run(task.start)
            except BaseException as e:
                task.future.set_exception(e)
                continue
            if not isinstance(started, Generator):
                task.future.set_result(started)
                continue
            task.job = started
            if self._step(task, None, None):
                active.append(task)

    def _step(self, task: _Task, value: torch.Tensor | None, error: BaseException | None) -> bool:
        """Run the job to its next forward request (True) or to its end (False)."""
        assert task.job is not None
        try:
            if error is not None:
                request = task.context.run(task.job.throw, error)
            else:
                request = task.context.run(task.job.send, value)
        except StopIteration as stop:
            task.future.set_result(stop.value)
            return False
        except BaseException as e:
            task.future.set_exception(e)
            return False
        if not isinstance(request, ForwardRequest):
            task.job.close()
            task.future.set_exception(TypeError(f"a model job yielded {request!r}"))
            return False
        task.request = request
        return True

    def _select(self, active: list[_Task]) -> list[_Task]:
        """The oldest pending requests that fit max_batch_size rows and max_batch_tokens
        padded tokens (rows x longest input), and of which at least half the padded tokens
        are real (a one-token step does not ride along a 512-token prefill chunk, padded to
        512, nor the reverse; it takes the next forward); the oldest always runs."""
        batch: list[_Task] = []
        longest = real = 0
        for task in active:
            n = len(task.request.tokens)
            wider = max(longest, n)
            padded = (len(batch) + 1) * wider
            if batch and (
                len(batch) >= self.max_batch_size
                or padded > self.max_batch_tokens
                or 2 * (real + n) < padded
            ):
                continue
            batch.append(task)
            longest, real = wider, real + n
        return batch


# -- the padded batch forward -----------------------------------------------------------------


def pad_caches(caches: list, lengths: list[int], config) -> Any:
    """A DynamicCache of the caches' layers left-padded with zeros to the longest
    ([B, heads, L, dim] per layer); an empty one when every cache is empty."""
    from transformers import DynamicCache

    batch = DynamicCache(config=config)
    width = max(lengths)
    if width == 0:
        return batch
    full = next(c for c, n in zip(caches, lengths, strict=True) if n)
    for i, layer in enumerate(full.layers):
        _, heads, _, dim = layer.keys.shape
        keys = layer.keys.new_zeros(len(caches), heads, width, dim)  # [B, heads, L, dim]
        values = layer.values.new_zeros(len(caches), heads, width, layer.values.shape[-1])
        for row, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
            if n:
                keys[row, :, width - n :] = cache.layers[i].keys[0]
                values[row, :, width - n :] = cache.layers[i].values[0]
        batch.update(keys, values, i)
    return batch


def batch_inputs(
    token_rows: list[list[int]], lengths: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, N] (right-padded with 0), attention_mask [B, L + N], position_ids [B, N]
    for inputs token_rows after caches of `lengths` (see the module docstring)."""
    rows, width, longest = len(token_rows), max(lengths), max(len(t) for t in token_rows)
    input_ids = torch.zeros(rows, longest, dtype=torch.long)
    mask = torch.zeros(rows, width + longest, dtype=torch.long)
    steps = torch.arange(longest)
    positions = torch.empty(rows, longest, dtype=torch.long)
    for row, (tokens, n) in enumerate(zip(token_rows, lengths, strict=True)):
        input_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        mask[row, width - n : width + len(tokens)] = 1
        positions[row] = n + steps
    return input_ids.to(device), mask.to(device), positions.to(device)


def write_back(batch_cache, caches: list, width: int, news: list[int]) -> None:
    """Append row i's new slots [width, width + news[i]) of every layer to caches[i]."""
    for i, layer in enumerate(batch_cache.layers):
        for row, (cache, n) in enumerate(zip(caches, news, strict=True)):
            cache.update(
                layer.keys[row : row + 1, :, width : width + n],
                layer.values[row : row + 1, :, width : width + n],
                i,
            )
