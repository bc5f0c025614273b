"""Batching across sessions: the model thread's scheduler loop and the padded batch forward.

Why this mechanism. With the dense engine (--engine dense) each session keeps its own
transformers ``DynamicCache`` (rollback is a crop, a miss is a dict lookup, eviction drops
one object: none of that changes). A forward over several sessions gathers their caches
into one *padded* batch for the duration of that forward and writes each row's new
key/value slice back to its own cache afterwards; the padded batch uses the model's own
forward unchanged. The paged engine (--engine paged, specdec.replica.paged) lays the batch
out the same way (`Layout`: the same rows, mask and positions) but reads the sessions'
keys/values from blocks of a shared pool in place, one layer at a time, and writes the new
ones there once: no padded copy of every layer, no write-back.

How a forward of B rows is laid out. A session's request is one row; an SSD branch step (a
`BranchStep` of a `BranchGroup`, specdec.drafter.speculate) is one row per branch, each
over the same session's cache. Row i has c_i cached slots (a session's l_i; a branch row's
session slots l plus the f tokens it was fed so far) and n_i inputs (a branch row: 1);
L = max c_i, N = max n_i:

- keys/values of every layer: [B, heads, L, dim], row i left-padded with zeros to L (its
  c_i cached slots at the end: a branch row holds a copy of its session's l slots, then its
  own f);
- input_ids [B, N]: row i's tokens, right-padded (pad id 0);
- attention_mask [B, L + N]: 1 on row i's cached slots and on its n_i real inputs, 0 on the
  left pads and the right pads; a branch row (a, t) also has 0 on the session's slots of
  d_{a+1}..d_k (the draft tokens its outcome rejected). The model's causal mask then lets
  a real query see exactly its own cache and the inputs before it (a right pad comes after
  every real input, so no real query sees it; every query sees at least itself, so no row
  is fully masked);
- position_ids [B, N]: the true position of input j of row i, as unbatched (l_i + j; a
  branch row's base + a + f);
- after the forward, row i's new keys/values are slots [L, L + n_i) of the batch cache,
  appended to its session's cache (a branch row's to its group's own slots, never to the
  session's); its logits are the last `keep` of its real inputs (a branch row's one),
  computed through the output head only for those rows.

A masked slot gets zero attention weight, so a row's result equals its unbatched forward up
to floating-point reduction order (tests/unit/test_batching.py and
tests/unit/test_branch_batching.py check fp32 tolerance; the integration tests check greedy
output equals ``generate()`` token for token).

Memory cost (the dense engine; the paged engine's is in specdec.replica.paged): during a
batched forward the padded copy of the batch's KV, B x (L + N) slots per layer (keys and
values), exists next to the sessions' own caches, and the model's
concatenation of the new slots briefly doubles one layer of it. For the Qwen2.5-Coder 1.5B
target in bfloat16 (28 layers, 2 KV heads of 128) a slot costs 28 KB: 8 sessions at 2,048
tokens is about 460 MB, freed when the forward returns. A batch of one session's request
runs today's unbatched forward on the session's own cache: no copy. A branch group costs
one row per branch: a Speculate of fan-out 6 on a session of 2,048 tokens puts 6 x (2,048 +
f + 1) slots into each of its forwards, about 150 MB on the Qwen2.5-Coder 0.5B drafter in
bfloat16 (24 layers, 2 KV heads of 64: 12 KB a slot), and two such sessions' branch steps
in one forward twice that; a short session's rows padded to a long one's L cost rows x L.
Between its forwards a group keeps only its rows' own slots (fan-out x steps), so the
copies exist during a forward only, where before batching a Speculate held its fan-out
copies for the whole call. --ssd-max-branch-tokens bounds each Speculate's rows (fan-out
x (l + steps)) as before; --max-batch-size bounds the rows of a forward.

The scheduler. The model thread runs one loop. A model call (Draft, Verify, Speculate,
Info, ...) is a *job*: a generator that validates and acquires its session's cache on the
model thread, then yields a request (`ForwardRequest`, or a `BranchStep` for SSD branches)
for every forward it needs and receives that forward's logits (a plain function is a job
without forwards). Whenever the model is free, the loop admits waiting jobs (oldest first,
up to --max-batch-size in flight, one job per session at a time so a session's jobs never
interleave), runs each to its next forward request, and runs one forward over the pending
requests that fit --max-batch-size rows (a branch step counts one row per branch) and
--max-batch-tokens padded tokens (rows x longest input), oldest first, skipping a request
that would make padding more than half the forward (short steps and long prefill chunks
run in separate forwards). The oldest request always runs, alone if it does not fit with
another (a branch group wider than --max-batch-size too), so none starves. Nothing waits
for a batch to fill: an idle model runs whatever is pending, alone if it is alone
(continuous batching), except that a forward may wait up to --max-batch-wait-ms for the
sessions of the previous forward to come back (`Scheduler._gathering`). A Draft's k steps are k successive requests, and so are
a Speculate's branch steps, so the drafting sessions and the branches of several sessions'
Speculates step in lock-step and leave the batch when done; a job that fails (cache miss,
capacity, bad input) fails alone, before it joins a forward. A forward that raises fails
the jobs in it (each drops its session cache, as unbatched). --max-batch-size 1 runs one
job at a time to completion: the behaviour before batching (a branch group alone runs the
model's own forward over its rows, as it did).

Waking up. The loop sleeps in a selector (`Poller`), never on a condition variable: a
`submit` from another thread (the gRPC servicers' event loop) wakes it through a socket
pair, and sockets registered on `Scheduler.io` (the data plane's connections,
specdec.replica.dataplane) wake it directly, their callbacks running on the model thread
itself. Between two forwards the loop polls the selector without blocking, so a call read
from a socket joins the next forward.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike
    from transformers.cache_utils import DynamicCache

    from specdec.replica.features import FeatureSink

log = logging.getLogger(__name__)


@dataclass
class ForwardRequest:
    """One session's share of a forward: feed `tokens` after its cache, return the logits
    of the last `keep` of them [keep, vocab] fp32. One row of the batch."""

    session: Any  # specdec.replica.runtime.SessionCache
    tokens: list[int] | torch.Tensor  # [n]: a device tensor for tokens drawn there
    keep: int
    fresh: bool  # part of a prefill (metrics)
    # A token tree over the last len(tree) tokens: each one's parent among them (-1: the
    # token before the tree). Its row attends under a tree mask (`tree_visibility`).
    tree: list[int] | None = None
    # The target's features asked for (specdec.replica.features): the forward appends the
    # asked decoder layers' outputs at these tokens [n, width] to it.
    features: FeatureSink | None = None
    # A head drafter's per-token inputs [n, width] (specdec.drafter.head): the feature each
    # token is fed with beside its embedding. None for every other model.
    inputs: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return 1

    @property
    def width(self) -> int:
        return len(self.tokens)


@dataclass
class BranchGroup:
    """Rows drafted side by side over one session's cache (SSD branches,
    specdec.drafter.speculate): row i sees the first visible[i] slots of the session's
    cache, then the tokens fed to it so far (its own keys/values, kept here). The session's
    cache is read, never changed: its job is in flight, so no other job touches it."""

    session: Any  # specdec.replica.runtime.SessionCache
    visible: list[int]  # [rows]
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [rows, heads, fed, dim]
    values: list[torch.Tensor] = field(default_factory=list)  # per layer [rows, heads, fed, dim]
    fed: int = 0  # tokens fed to every row

    def positions(self) -> list[int]:
        """The position of each row's next token: its visible slots + the fed ones."""
        return [v + self.fed for v in self.visible]


@dataclass
class BranchStep:
    """Feed one token to every row of a BranchGroup; return each row's logits after it
    [rows, vocab] fp32. As many rows of the batch as the group has."""

    group: BranchGroup
    tokens: list[int] | torch.Tensor  # [rows]: a device tensor for tokens drawn there
    fresh: bool = False  # never a prefill (metrics)
    # As ForwardRequest's: the asked layers' outputs at the rows' tokens go to `features`
    # [rows, width]; a head drafter's rows are fed `inputs` [rows, width] beside them.
    features: FeatureSink | None = None
    inputs: torch.Tensor | None = None

    @property
    def session(self) -> Any:
        return self.group.session

    @property
    def rows(self) -> int:
        return len(self.tokens)

    @property
    def width(self) -> int:
        return 1


# What a job may ask of a forward.
ModelRequest = ForwardRequest | BranchStep
REQUEST_TYPES = (ForwardRequest, BranchStep)

# A job yields requests, receives their logits, and returns its result.
ModelJob = Generator[ModelRequest, torch.Tensor, Any]


@dataclass
class _Task:
    seq: int
    start: Callable[[], Any]  # returns a ModelJob (or the result itself: a plain call)
    key: str | None  # session id: one task per key in flight
    context: contextvars.Context
    future: Future[Any] = field(default_factory=Future)
    job: ModelJob | None = None
    request: ModelRequest | None = None
    queued: float = field(default_factory=time.perf_counter)  # when it was submitted


class Poller:
    """A selector whose callbacks run on the thread that polls it (the model thread), and
    a queue of calls for that thread.

    register(fileobj, events, callback): callback(events_ready) runs on the polling thread
    when fileobj is ready; register, modify and unregister only on that thread (or before
    it polls: `call_soon` gets there from elsewhere). call_soon(fn) and wake() from any
    thread.
    """

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._drain)
        self._calls: deque[Callable[[], None]] = deque()
        self.thread: threading.Thread | None = None  # the polling thread, set when it polls
        # Run before every select, on the polling thread: writers flush what the last
        # steps queued (the replies of one forward leave in one write per connection).
        self.before_select: list[Callable[[], None]] = []
        # The stand-in during long forwards (`stand_in_during_forwards`): off until asked.
        self._stand_in: threading.Thread | None = None
        self._guard = threading.Lock()  # the two fields below
        self._forward_since: float | None = None  # when the running forward began
        self._held = False  # the stand-in holds the selector (until the forward ends)
        self._released = threading.Event()  # the stand-in gave the selector back
        self._closing = threading.Event()

    def stand_in_during_forwards(self, after: float) -> None:
        """Poll the selector from a stand-in thread while a forward runs past `after`
        seconds, so that a long forward does not leave the sockets unread (a gateway holds
        a replica silent past its keepalive timeout dead).

        Rule: a forward that ends within `after` seconds costs one uncontended lock on
        each side (`forward_begins`, `forward_ends`) and no thread switch; the stand-in
        wakes every `after` seconds and takes the selector over from a forward that has run
        at least that long, so a pong waits at most about 2 x `after`. While it holds the
        selector the model thread runs the forward and touches no registered object; the
        stand-in runs the before_select hooks and the I/O callbacks (`standing_in()` is
        true there: a callback does only what is safe off the model thread and leaves the
        rest for it), never the call_soon queue. When the forward ends the model thread
        wakes the stand-in and waits until it has let go.
        """
        if self._stand_in is not None:
            return
        self._stand_in = threading.Thread(
            target=self._stand_in_loop,
            args=(after,),
            name=f"{threading.current_thread().name}-stand-in",
            daemon=True,
        )
        self._stand_in.start()

    def standing_in(self) -> bool:
        """Whether this is the stand-in thread (holding the selector during a forward)."""
        return self._stand_in is not None and threading.current_thread() is self._stand_in

    def forward_begins(self) -> None:
        """The model thread starts a forward (it polls nothing until `forward_ends`)."""
        if self._stand_in is not None:
            with self._guard:
                self._forward_since = time.monotonic()

    def forward_ends(self) -> None:
        """The forward is over: take the selector back from the stand-in if it holds it."""
        if self._stand_in is None:
            return
        with self._guard:
            self._forward_since = None
            held = self._held
        if held:
            self.wake()
            self._released.wait()
            self._released.clear()

    def _stand_in_loop(self, after: float) -> None:
        while not self._closing.wait(after):
            with self._guard:
                since = self._forward_since
                self._held = since is not None and time.monotonic() - since >= after
                if not self._held:
                    continue
            try:
                while True:
                    with self._guard:
                        if self._forward_since is None:
                            break
                    for hook in self.before_select:
                        hook()
                    for key, mask in self._selector.select(None):
                        try:
                            key.data(mask)
                        except Exception:
                            log.exception("an I/O callback failed (stand-in)")
            except Exception:  # never leave the model thread waiting for the selector
                log.exception("the stand-in failed; the model thread polls after the forward")
            finally:
                with self._guard:
                    self._held = False
                self._released.set()

    def register(
        self, fileobj: FileDescriptorLike, events: int, callback: Callable[[int], None]
    ) -> None:
        self._selector.register(fileobj, events, callback)

    def modify(
        self, fileobj: FileDescriptorLike, events: int, callback: Callable[[int], None]
    ) -> None:
        self._selector.modify(fileobj, events, callback)

    def unregister(self, fileobj: FileDescriptorLike) -> None:
        self._selector.unregister(fileobj)

    def on_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run fn on the polling thread at its next poll (any thread)."""
        self._calls.append(fn)
        self.wake()

    def wake(self) -> None:
        """Make the current or next select return at once (any thread)."""
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, InterruptedError):
            pass  # the pair is full of wake-ups already
        except OSError:
            pass  # closed: the loop has ended

    def _drain(self, _events: int) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def select(self, timeout: float | None) -> list[tuple[selectors.SelectorKey, int]]:
        """Wait for ready file objects (None: as long as it takes; 0: do not wait)."""
        self.thread = threading.current_thread()
        for hook in self.before_select:
            hook()
        return self._selector.select(timeout)

    def dispatch(self, events: list[tuple[selectors.SelectorKey, int]]) -> None:
        """Run the callbacks of `events`, then the queued calls (the polling thread)."""
        for key, mask in events:
            try:
                key.data(mask)
            except Exception:  # a callback's failure is its owner's; the loop goes on
                log.exception("an I/O callback failed")
        while self._calls:
            fn = self._calls.popleft()
            try:
                fn()
            except Exception:
                log.exception("a call on the model thread failed")

    def poll(self, timeout: float | None) -> None:
        self.dispatch(self.select(timeout))

    def close(self) -> None:
        self._closing.set()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


class Scheduler:
    """The model thread: admits jobs, batches their forwards (see the module docstring).

    run_batch(requests) runs one forward over the requests (a list of one: unbatched) and
    returns each one's logits; it is called in the context of the batch's oldest job.
    note_member(request, batch) is called in the context of every other job of a batch.
    `io`: the selector the loop sleeps in (see Poller); its callbacks run on this thread.
    """

    def __init__(
        self,
        name: str,
        max_batch_size: int,
        max_batch_tokens: int,
        run_batch: Callable[[list[ModelRequest]], list[torch.Tensor]] | None = None,
        note_member: Callable[[ModelRequest, int], None] | None = None,
        max_batch_wait: float = 0.0,
    ):
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        # Gathering (see `_gathering`): seconds a forward may wait for sessions of the
        # previous forward whose next request has not arrived yet (0: never waits).
        self.max_batch_wait = max_batch_wait
        self._expected: set[str] = set()  # sessions of the last forward awaited back
        self._last_forward = 0.0  # seconds the last forward took
        # Each session's turnaround: seconds from the end of the forward that ended its
        # job to its next job's submission (the gateway's handling of the reply, or a
        # Draft first), the last measured; and when its last job ended. Both bounded.
        self._turnaround: dict[str, float] = {}
        self._ended: dict[str, float] = {}
        self._gather_until: float | None = None  # the deadline of the current wait
        self.run_batch = run_batch
        self.note_member = note_member
        self.io = Poller()
        self._lock = threading.Lock()
        self._waiting: deque[_Task] = deque()
        self._seq = itertools.count()
        self._stopped = False
        self._sleeping = False  # the loop waits in io.select(None): a submit must wake it
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.io.thread = self._thread
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------

    def submit(
        self,
        start: Callable[[], Any],
        key: str | None = None,
        context: contextvars.Context | None = None,
    ) -> Future[Any]:
        """Queue a job: start() runs on the model thread in `context` (a copy of the
        caller's when None) and returns a ModelJob generator or a plain result."""
        task = _Task(next(self._seq), start, key, context or contextvars.copy_context())
        with self._lock:
            if self._stopped:
                raise RuntimeError("the model thread is shut down")
            self._waiting.append(task)
            wake, self._sleeping = self._sleeping, False
        if wake:
            self.io.wake()
        return task.future

    def shutdown(self) -> None:
        """Stop the loop; jobs not started are cancelled (the running forward finishes)."""
        with self._lock:
            self._stopped = True
            waiting, self._waiting = list(self._waiting), deque()
        self.io.wake()
        for task in waiting:
            task.future.cancel()

    # -- the model thread ---------------------------------------------------------------

    def _loop(self) -> None:
        active: list[_Task] = []  # started jobs waiting for a forward, oldest first
        try:
            while True:
                self._poll(active)
                if self._stopped:
                    break
                self._admit(active)
                if not active or self._gathering(active):
                    continue
                self._forward(active)
            for task in active:
                task.future.set_exception(RuntimeError("the model thread was shut down"))
                if task.job is not None:
                    task.job.close()
        finally:
            self.io.close()

    def _poll(self, active: list[_Task]) -> None:
        """Run the I/O that is ready; sleep until some is (or a submit) when there is
        nothing else to do."""
        with self._lock:
            idle = not active and not self._waiting and not self._stopped
            self._sleeping = idle
        events = self.io.select(None if idle else 0)
        if idle:
            with self._lock:
                self._sleeping = False
        self.io.dispatch(events)

    def _gathering(self, active: list[_Task]) -> bool:
        """Whether to hold the next forward a little longer (True: the loop polls again).

        Sessions of a batch come back together: each one's next request (its next round)
        leaves the gateway once that session's reply has been handled, so the replies of a
        forward of n sessions return within the time the gateway takes to handle n
        replies (a fraction of a millisecond each on a quiet machine, several on a busy
        one). Running the forward as soon as the first is back splits the sessions into
        two groups that then alternate, every round of each waiting for the other's
        forward: half the rows a forward. So while a session whose job ended in the last
        forward has not sent its next request, the forward waits for it, for at most
        max_batch_wait and a quarter of the last forward's time (a session that ended its
        request does not come back: it costs one such wait). A session whose last
        turnaround (from the forward that ended its job to its next job) was longer than
        that is not awaited: it drafts between its Verifies, say. A session alone never
        waits: its own request is the one that is back.
        """
        if not self.max_batch_wait or not self._expected:
            return False
        with self._lock:
            back = {t.key for t in active} | {t.key for t in self._waiting}
        missing = self._expected - back
        if not missing or len(active) >= self.max_batch_size:
            self._gather_until = None
            return False
        now = time.perf_counter()
        if self._gather_until is None:
            self._gather_until = now + self._wait_bound()
        if now >= self._gather_until:
            self._expected.clear()  # late or gone: the next forward runs without them
            self._gather_until = None
            return False
        self.io.dispatch(self.io.select(self._gather_until - now))  # a frame or a submit
        return True

    def _forward(self, active: list[_Task]) -> None:
        """One forward over the oldest requests that fit, then each job to its next step."""
        batch = self._select(active)
        requests = [_request(t) for t in batch]
        started = time.perf_counter()
        results: list[torch.Tensor | None]
        self.io.forward_begins()
        try:
            results = list(batch[0].context.run(self._run, requests))
            error = None
        except BaseException as e:  # the jobs in this forward get the error
            results, error = [None] * len(batch), e
        finally:
            self.io.forward_ends()
        ended = time.perf_counter()
        self._last_forward = ended - started
        self._gather_until = None
        self._expected.clear()
        for task, result in zip(batch, results, strict=True):
            active.remove(task)
            if error is None and task is not batch[0] and self.note_member is not None:
                task.context.run(self.note_member, _request(task), len(batch))
            if self._step(task, result, error):
                active.append(task)
            elif task.key is not None:
                self._job_ended(task.key, ended)
        active.sort(key=lambda t: t.seq)

    def _job_ended(self, key: str, ended: float) -> None:
        """A session's job ended in the forward that ended at `ended`: awaited back by the
        next forward unless it last came back later than a wait could cover (a session
        that drafts between its Verifies)."""
        self._ended[key] = ended
        if self._turnaround.get(key, 0.0) <= self._wait_bound():
            self._expected.add(key)
        for bounded in (self._ended, self._turnaround):
            while len(bounded) > 4 * self.max_batch_size:  # the oldest first
                del bounded[next(iter(bounded))]

    def _wait_bound(self) -> float:
        """The longest a forward waits for sessions to come back (`_gathering`)."""
        return min(self.max_batch_wait, self._last_forward / 4)

    def _note_back(self, task: _Task) -> None:
        """A session's job starts: its turnaround since its last job ended."""
        if task.key is not None and (ended := self._ended.pop(task.key, None)) is not None:
            self._turnaround.pop(task.key, None)  # re-inserted: the newest last
            self._turnaround[task.key] = max(0.0, task.queued - ended)

    def _run(self, requests: list[ModelRequest]) -> list[torch.Tensor]:
        if self.run_batch is None:
            raise RuntimeError("this scheduler has no model to run forwards on")
        return self.run_batch(requests)

    def _admit(self, active: list[_Task]) -> None:
        """Start waiting jobs, oldest first, while fewer than max_batch_size are in flight;
        a job whose session already has one in flight waits for it."""
        while len(active) < self.max_batch_size:
            with self._lock:
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
            self._note_back(task)
            if self._step(task, None, None):
                active.append(task)

    def _step(self, task: _Task, value: torch.Tensor | None, error: BaseException | None) -> bool:
        """Run the job to its next forward request (True) or to its end (False)."""
        assert task.job is not None
        try:
            if error is not None:
                request = task.context.run(task.job.throw, error)
            elif value is None:  # the job's start (a forward without an error gave a value)
                request = task.context.run(next, task.job)
            else:
                request = task.context.run(task.job.send, value)
        except StopIteration as stop:
            task.future.set_result(stop.value)
            return False
        except BaseException as e:
            task.future.set_exception(e)
            return False
        if not isinstance(request, REQUEST_TYPES):
            task.job.close()
            task.future.set_exception(TypeError(f"a model job yielded {request!r}"))
            return False
        task.request = request
        return True

    def _select(self, active: list[_Task]) -> list[_Task]:
        """The oldest pending requests that fit max_batch_size rows (a request of a
        session is one row, a BranchStep as many as its group has) and max_batch_tokens
        padded tokens (rows x longest input), and of which at least half the padded tokens
        are real (a one-token step does not ride along a 512-token prefill chunk, padded to
        512, nor the reverse; it takes the next forward); the oldest always runs, alone if
        it does not fit alone."""
        batch: list[_Task] = []
        rows = longest = real = 0
        for task in active:
            request = _request(task)
            wider = max(longest, request.width)
            padded = (rows + request.rows) * wider
            fed = request.rows * request.width
            if batch and (
                rows + request.rows > self.max_batch_size
                or padded > self.max_batch_tokens
                or 2 * (real + fed) < padded
            ):
                continue
            batch.append(task)
            rows, longest, real = rows + request.rows, wider, real + fed
        return batch


# -- the padded batch forward -----------------------------------------------------------------


def tree_visibility(n: int, parents: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """A row of n inputs whose last m = len(parents) are a token tree: which input each
    input may attend [n, n] bool (a plain input: the plain inputs up to itself; a node:
    every plain input, its ancestors and itself), and each node's depth [m] (a child of
    the last plain input: 0). A node's position is the row's cached length + the plain
    inputs + its depth."""
    h = n - len(parents)
    sees = torch.zeros(n, n, dtype=torch.bool)
    sees[:h, :h] = torch.ones(h, h, dtype=torch.bool).tril()
    depth: list[int] = []
    for i, parent in enumerate(parents):
        row = h + i
        if parent >= 0:
            sees[row] = sees[h + parent]
        else:
            sees[row, :h] = True
        sees[row, row] = True
        depth.append(depth[parent] + 1 if parent >= 0 else 0)
    return sees, depth


class Layout:
    """How one forward over several requests is laid out (see the module docstring): row
    blocks in the requests' order, a session's request one row, a BranchStep one row per
    branch; R rows, L = the longest cached length (session slots + a branch row's fed
    slots), N = the longest input.

    columns, width_multiple (compiled forwards, specdec.replica.compiled): the inputs are
    right-padded to `columns` (a bucket >= N) and L is rounded up to a multiple of
    `width_multiple` (more left pads); pads are masked like any other."""

    def __init__(self, requests: list[ModelRequest], columns: int = 0, width_multiple: int = 1):
        self.requests = requests
        self.starts = list(itertools.accumulate((r.rows for r in requests), initial=0))
        self.rows = self.starts.pop()  # R
        # Cached slots of each request's rows: the session's, plus what a branch row was fed.
        self.cached = [len(r.session.tokens) + _fed(r) for r in requests]
        self.width = -(-max(self.cached) // width_multiple) * width_multiple  # L
        self.longest = max(r.width for r in requests)  # N
        self.columns = max(self.longest, columns)  # the inputs' width: N, or its bucket
        self.tokens = sum(len(r.tokens) for r in requests)  # real inputs over all rows
        self.keeps = [r.rows if isinstance(r, BranchStep) else r.keep for r in requests]

    @property
    def trees(self) -> bool:
        """Whether a row is a token tree (`inputs` then gives a 4D mask)."""
        return any(isinstance(r, ForwardRequest) and r.tree for r in self.requests)

    def inputs(
        self, device: torch.device, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids [R, N] (right-padded with 0), attention_mask [R, L + N] (0 on the left
        pads, on a branch row's hidden session slots, on the right pads), position_ids
        [R, N] (each row's true positions). With a token tree among the rows the mask is
        4D and additive [R, 1, N, L + N] in `dtype`: the same keys, causal, and a tree
        row's nodes see their ancestors only (`tree_visibility`); its nodes' positions
        follow their depth."""
        width, longest = self.width, self.columns
        input_ids = torch.zeros(self.rows, longest, dtype=torch.long)
        mask = torch.zeros(self.rows, width + longest, dtype=torch.long)
        positions = torch.empty(self.rows, longest, dtype=torch.long)
        steps = torch.arange(longest)
        on_device: list[
            tuple[tuple[Any, Any], torch.Tensor]
        ] = []  # (rows, tokens): tokens drawn on the device, placed once there
        for r, start, cached in zip(self.requests, self.starts, self.cached, strict=True):
            pad, length = width - cached, len(r.session.tokens)
            if isinstance(r, BranchStep):
                rows = slice(start, start + r.rows)
                visible = torch.tensor(r.group.visible, dtype=torch.long)  # [n]
                if isinstance(r.tokens, torch.Tensor):
                    on_device.append(((rows, 0), r.tokens))
                else:
                    input_ids[rows, 0] = torch.tensor(r.tokens, dtype=torch.long)
                slots = torch.arange(length)
                mask[rows, pad : pad + length] = (slots[None, :] < visible[:, None]).long()
                mask[rows, pad + length : width + 1] = 1  # its fed slots and its input
                positions[rows] = torch.tensor(r.group.positions())[:, None] + steps
            else:
                n = len(r.tokens)
                if isinstance(r.tokens, torch.Tensor):
                    on_device.append(((start, slice(0, n)), r.tokens))
                else:
                    input_ids[start, :n] = torch.tensor(r.tokens, dtype=torch.long)
                mask[start, pad : width + n] = 1
                positions[start] = length + steps
        if self.trees:
            mask = self._tree_mask(mask, positions, dtype)
        input_ids = input_ids.to(device)
        for where, tokens in on_device:
            input_ids[where] = tokens
        return input_ids, mask.to(device), positions.to(device)

    def _tree_mask(
        self, keys: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The 4D additive mask of `inputs` from its 2D one (keys [R, L + N]); sets the tree
        rows' node positions in `positions` [R, N]."""
        width, longest = self.width, self.columns
        steps = torch.arange(longest)
        causal = torch.ones(longest, width + longest, dtype=torch.bool)
        causal[:, width:] = steps[None, :] <= steps[:, None]
        visible = keys.bool()[:, None, :] & causal[None]  # [R, N, L + N]
        for r, start in zip(self.requests, self.starts, strict=True):
            if isinstance(r, ForwardRequest) and r.tree:
                n, m = len(r.tokens), len(r.tree)
                sees, depth = tree_visibility(n, r.tree)
                visible[start, :n, width : width + n] = sees
                base = len(r.session.tokens) + n - m
                positions[start, n - m : n] = torch.tensor([base + d for d in depth])
        additive = torch.zeros(self.rows, 1, longest, width + longest, dtype=dtype)
        return additive.masked_fill_(~visible[:, None], torch.finfo(dtype).min)

    def cache(self, config: Any) -> DynamicCache:
        """A DynamicCache of every row's cached keys/values, left-padded with zeros to L
        ([R, heads, L, dim] per layer): a session's cache in its row, the session's cache
        in every row of a branch group followed by that row's fed slots; an empty one when
        every cache is empty."""
        from transformers import DynamicCache

        batch = DynamicCache(config=config)
        width = self.width
        if width == 0:
            return batch
        full = next(r.session.kv for r in self.requests if r.session.tokens)
        for i, layer in enumerate(full.layers):
            _, heads, _, dim = layer.keys.shape
            keys = layer.keys.new_zeros(self.rows, heads, width, dim)  # [R, heads, L, dim]
            values = layer.values.new_zeros(self.rows, heads, width, layer.values.shape[-1])
            for r, start, cached in zip(self.requests, self.starts, self.cached, strict=True):
                rows, length, fed = slice(start, start + r.rows), len(r.session.tokens), _fed(r)
                if length:  # one copy per row (a branch group's rows share the session's)
                    own = r.session.kv.layers[i]
                    keys[rows, :, width - cached : width - fed] = own.keys[0]
                    values[rows, :, width - cached : width - fed] = own.values[0]
                if fed:
                    assert isinstance(r, BranchStep)  # only a branch step feeds its own KV
                    keys[rows, :, width - fed :] = r.group.keys[i]
                    values[rows, :, width - fed :] = r.group.values[i]
            batch.update(keys, values, i)
        return batch

    def kept(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of hidden [R, N, hidden] whose logits the requests keep [sum keeps,
        hidden]: the last `keep` real inputs of a session's row, every row of a group."""
        parts = []
        for r, start in zip(self.requests, self.starts, strict=True):
            if isinstance(r, BranchStep):
                parts.append(hidden[start : start + r.rows, 0])
            else:
                n = len(r.tokens)
                parts.append(hidden[start, n - r.keep : n])
        return torch.cat(parts)

    def split(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Logits [sum keeps, vocab] -> each request's ([keep, vocab] or [rows, vocab])."""
        return list(torch.split(logits, self.keeps))

    def write_back(self, batch_cache: Any) -> None:
        """Each row's new slots [L, L + n) after the forward: appended to its session's
        cache (and tokens), or to its branch row's fed slots. batch_cache: the `cache`
        the forward ran on (Any: transformers types a cache's layers as a union of kinds,
        some without keys and values; this one's are full-attention layers, filled)."""
        width = self.width
        for i, layer in enumerate(batch_cache.layers):
            for r, start in zip(self.requests, self.starts, strict=True):
                if isinstance(r, BranchStep):
                    rows, group = slice(start, start + r.rows), r.group
                    new_keys = layer.keys[rows, :, width : width + 1]  # [n, heads, 1, dim]
                    new_values = layer.values[rows, :, width : width + 1]
                    if group.fed:
                        group.keys[i] = torch.cat([group.keys[i], new_keys], dim=2)
                        group.values[i] = torch.cat([group.values[i], new_values], dim=2)
                    else:  # a copy: the batch's tensors are freed after the forward
                        group.keys.append(new_keys.clone())
                        group.values.append(new_values.clone())
                else:
                    n = len(r.tokens)
                    r.session.kv.update(
                        layer.keys[start : start + 1, :, width : width + n],
                        layer.values[start : start + 1, :, width : width + n],
                        i,
                    )
        for r in self.requests:
            if isinstance(r, BranchStep):
                r.group.fed += 1
            else:
                r.session.append(r.tokens)


def _request(task: _Task) -> ModelRequest:
    """An active task's forward request (set when its job yields it)."""
    assert task.request is not None
    return task.request


def _fed(request: ModelRequest) -> int:
    return request.group.fed if isinstance(request, BranchStep) else 0
