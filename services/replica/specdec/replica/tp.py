"""Tensor-parallel verifier: one replica as N ranks, the model sharded across them.

`--tensor-parallel N` (verifier only) runs one verifier replica as N processes on one
machine. Each loads its shard of the model through transformers' tensor-parallel plan
(``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``: the attention and MLP
projections split column- or row-wise, each layer's partial results all-reduced, the
output layer gathered), under torch.distributed: gloo on ``--device cpu``, NCCL on
``--device cuda`` (rank r on cuda:r). Every rank computes the same logits.

Only rank 0 serves: gRPC, the data plane, the scheduler and the jobs run there as with one
rank (`TensorParallelRuntime` is a ModelRuntime). The follower ranks hold the same
sessions as rank 0, their KV being their shard of the heads, and replay every engine
operation rank 0 performs, in the same order: the session store's acquire (prefix reuse,
forks, eviction), truncate (rollback of rejected drafts), keep_path, fill and release, and every
forward over the sessions (`_run_batch`, batched or not). Rank 0 sends each operation on a
gloo group of its own (`broadcast_object_list`) just before it runs it, from the model
thread, so the order is the model thread's. A session is named by a handle both sides
assign in the same order (`_handle`); a session rank 0 has dropped and no job holds any
more is forgotten by the followers at the next operation. Work that is not an engine
operation (the start-up cost probe) runs on every rank as part of `load`.

Launch. Rank 0 is the verifier's own process (`specdec serve verifier --tensor-parallel
N`); while it loads it starts ranks 1..N-1 as child processes (``python -m
specdec.replica.tp``, the parsed configuration in their environment) and meets them on a
TCPStore on 127.0.0.1. One machine only; torchrun is not used.

Failure. A follower that exits takes rank 0 down: rank 0 logs which rank exited and with
what code, and exits (status 1), never waiting on a collective that cannot complete. A
follower whose rank 0 is gone (its parent process changed) exits too.

Refused with TP > 1 (specdec.replica.config.check_tensor_parallel): the drafter, the paged
engine, packed weights, --dtype fastest; token trees (draft_parents) are refused per
request (not run across ranks yet, though the store mirrors keep_path).
"""

from __future__ import annotations

import atexit
import base64
import dataclasses
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch

from specdec.replica.batching import ForwardRequest, ModelRequest
from specdec.replica.config import ReplicaConfig
from specdec.replica.kvstore import CacheStore, SessionCache
from specdec.replica.runtime import ModelRuntime

# One operation of rank 0, as the followers receive it: its name, then its arguments.
Operation = tuple[Any, ...]

log = logging.getLogger("specdec.replica.tp")  # __main__ in a follower

CONFIG_ENV = "SPECDEC_TP_CONFIG"  # a follower's configuration (pickled, base64)
# Operations wait this long at most on the control group (an idle follower waits there).
IDLE_TIMEOUT = timedelta(days=365)
STOP_SECONDS = 10.0  # how long a graceful stop waits for the followers to exit


class Ranks:
    """This process's place among the ranks: the process group, the control group, its
    device, and (on rank 0) the follower processes it started and watches."""

    def __init__(self, config: ReplicaConfig, rank: int):
        import torch.distributed as dist

        self.size = config.tensor_parallel
        self.rank = rank
        # cuda: a GPU a rank, rank r on GPU r (specdec.replica.replica.check_device)
        cuda = config.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(rank)
        self.device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        os.environ.setdefault("LOCAL_RANK", str(rank))  # transformers binds its device so
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method="env://", rank=rank, world_size=self.size
        )
        # Operations travel on a gloo group of their own (NCCL carries tensors only).
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.followers: list[subprocess.Popen[bytes]] = []

    def send(self, operation: Operation) -> None:
        """Rank 0: one operation to every follower."""
        import torch.distributed as dist

        dist.broadcast_object_list([operation], src=0, group=self.control)

    def receive(self) -> Operation:
        """A follower: the next operation of rank 0."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        operation: Operation = box[0]  # what rank 0's send broadcast
        return operation

    # -- rank 0 -------------------------------------------------------------------------

    @classmethod
    def start(cls, config: ReplicaConfig) -> Ranks:
        """Rank 0: start ranks 1..N-1 as child processes and meet them."""
        with socket.socket() as probe:  # a free port for rank 0's rendezvous store
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        shipped = dataclasses.replace(config, tls=None, metrics_port=0, data_port=-1)
        meet = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(config.tensor_parallel),
        }
        os.environ.update(meet)
        env = {
            **os.environ,
            CONFIG_ENV: base64.b64encode(pickle.dumps(shipped)).decode(),
        }
        followers = []
        for rank in range(1, config.tensor_parallel):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            command = [sys.executable, "-m", "specdec.replica.tp"]
            followers.append(subprocess.Popen(command, env=rank_env))
        log.info(
            "tensor-parallel ranks started",
            extra={
                "tensor_parallel": config.tensor_parallel,
                "follower_pids": [p.pid for p in followers],
                "port": port,
            },
        )
        # Watch them from now on: one that dies during the rendezvous or the load must not
        # leave rank 0 waiting for it.
        for rank, process in enumerate(followers, start=1):
            threading.Thread(
                target=_watch_follower, args=(rank, process), name=f"tp-rank-{rank}", daemon=True
            ).start()
        atexit.register(_end_followers, followers)
        ranks = cls(config, 0)
        ranks.followers = followers
        return ranks

    def stop(self) -> None:
        """Rank 0, on the model thread: tell the followers to exit and wait for them."""
        _stopping.set()
        try:
            self.send(("stop",))
        except Exception as e:  # a follower already gone: the watcher has said so
            log.warning("could not tell the tensor-parallel ranks to stop", extra={"why": str(e)})
        _end_followers(self.followers)


_stopping = threading.Event()  # rank 0 stops its followers: their exits are expected


def _watch_follower(rank: int, process: subprocess.Popen[bytes]) -> None:
    """Rank 0: a follower that exits while this replica serves takes it down."""
    code = process.wait()
    if _stopping.is_set():
        return
    log.error(
        "tensor-parallel rank exited; this verifier cannot run its model without it, so it "
        "stops (exit status 1)",
        extra={"rank": rank, "pid": process.pid, "exit_code": code},
    )
    _exit(1)


def _end_followers(followers: list[subprocess.Popen[bytes]]) -> None:
    """Rank 0 stops or exits: give its followers STOP_SECONDS to end, then kill them."""
    _stopping.set()
    deadline = time.monotonic() + STOP_SECONDS
    for process in followers:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _exit(status: int) -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(status)


# -- sessions by handle ----------------------------------------------------------------------

_handles = itertools.count(1)


def _handle(session: SessionCache) -> int:
    """The session's handle, assigned when first seen (both sides see sessions in the same
    order, so they assign the same handles)."""
    handle = getattr(session, "tp_handle", 0)
    if not handle:
        handle = session.tp_handle = next(_handles)  # type: ignore[attr-defined]
    return handle


class MirroredStore(CacheStore):
    """Rank 0's session store: every operation that changes a session goes to the
    followers first (an operation's inner calls, acquire's truncate, are not sent again)."""

    def __init__(self, ranks: Ranks, max_cached_tokens: int, new_cache: Callable[[], object]):
        super().__init__(max_cached_tokens, new_cache)
        self.ranks = ranks
        self._depth = 0  # inside a mirrored operation
        self._dead: deque[int] = deque()  # handles of sessions gone from rank 0

    def send(self, operation: Operation) -> None:
        if self._depth:
            return
        forgotten = []
        while self._dead:
            forgotten.append(self._dead.popleft())
        self.ranks.send((*operation, forgotten))

    @contextmanager
    def _mirrored(self, operation: Operation) -> Iterator[None]:
        """Around CacheStore's own operation: sent first, its inner calls not again."""
        self.send(operation)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def acquire(
        self,
        session_id: str,
        prefix_len: int,
        prefix_hash_: int,
        grow_by: int,
        fork_from: str = "",
    ) -> SessionCache:
        args = (session_id, prefix_len, prefix_hash_, grow_by, fork_from)
        with self._mirrored(("acquire", args)):
            session = super().acquire(*args)
        if not getattr(session, "tp_handle", 0):
            weakref.finalize(session, self._dead.append, _handle(session))
        return session

    def truncate(self, session: SessionCache, length: int) -> None:
        with self._mirrored(("truncate", _handle(session), length)):
            super().truncate(session, length)

    def keep_path(self, session: SessionCache, base: int, path: Sequence[int]) -> None:
        path = list(path)
        with self._mirrored(("keep_path", _handle(session), base, path)):
            super().keep_path(session, base, path)

    def fill(self, session: SessionCache, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        self.send(("fill", _handle(session), tokens))
        super().fill(session, tokens)

    def release(self, session_id: str) -> bool:
        with self._mirrored(("release", session_id)):
            return super().release(session_id)


class TensorParallelRuntime(ModelRuntime):
    """Rank 0 of a tensor-parallel verifier: a ModelRuntime whose load starts the other
    ranks and whose store and forwards they mirror."""

    ranks: Ranks | None = None
    mirror: MirroredStore | None = None  # the store, once loaded

    def load(self) -> None:
        self.ranks = Ranks.start(self.config)
        self.device = self.ranks.device
        super().load()

    def new_store(self, engine: str) -> CacheStore:
        assert self.ranks is not None and engine == "dense", "checked with the configuration"
        self.mirror = MirroredStore(self.ranks, self.config.max_cached_tokens, self._new_cache)
        return self.mirror

    def _run_batch(self, requests: list[ModelRequest]) -> list[torch.Tensor]:
        assert self.mirror is not None
        self.mirror.send(("forward", [_describe(r) for r in requests]))
        return super()._run_batch(requests)

    def shutdown(self) -> None:
        if self.ranks is not None:
            self.scheduler.io.call_soon(self.ranks.stop)  # after the running forward
        super().shutdown()


def _describe(request: ModelRequest) -> Operation:
    if not isinstance(request, ForwardRequest):
        raise TypeError(f"a tensor-parallel verifier runs session forwards only, not {request!r}")
    tokens = request.tokens
    tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
    return (_handle(request.session), tokens, request.keep, request.fresh, request.tree)


# -- the followers ---------------------------------------------------------------------------


def follow(config: ReplicaConfig, rank: int) -> None:
    """A follower rank: load its shard, then replay rank 0's operations until told to
    stop (or rank 0 is gone)."""
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent, rank), daemon=True).start()
    ranks = Ranks(config, rank)
    runtime = ModelRuntime(config)
    runtime.device = ranks.device
    runtime.load()
    log.info("tensor-parallel rank ready", extra={"rank": rank, "device": str(ranks.device)})
    sessions: dict[int, SessionCache] = {}
    try:
        while True:
            operation = ranks.receive()
            if operation[0] == "stop":
                break
            *call, forgotten = operation
            for handle in forgotten:
                sessions.pop(handle, None)
            _replay(runtime, sessions, *call)
    except Exception:
        log.exception("tensor-parallel rank lost rank 0; exiting", extra={"rank": rank})
        _exit(1)
    runtime.shutdown()
    log.info("tensor-parallel rank stopped", extra={"rank": rank})


def _replay(
    runtime: ModelRuntime, sessions: dict[int, SessionCache], name: str, *args: Any
) -> None:
    """One operation of rank 0 on this rank's store and shard. Whatever it raises, rank 0's
    raised too (a cache miss, the capacity bound): the same state either way."""
    store = runtime.store
    assert store is not None
    try:
        if name == "acquire":
            session = store.acquire(*args[0])
            sessions[_handle(session)] = session
        elif name == "truncate":
            store.truncate(sessions[args[0]], args[1])
        elif name == "keep_path":
            store.keep_path(sessions[args[0]], args[1], args[2])
        elif name == "fill":
            store.fill(sessions[args[0]], args[1])
        elif name == "release":
            store.release(args[0])
        elif name == "forward":
            runtime._run_batch([_request(sessions, *r) for r in args[0]])
        else:
            raise ValueError(f"unknown tensor-parallel operation {name!r}")
    except Exception as e:
        if name == "forward":  # rank 0's raised too, or the ranks now differ: say so
            log.exception("a replayed forward failed", extra={"operation": name})
        else:  # a cache miss, the capacity bound: as on rank 0
            log.debug("replayed operation raised", extra={"operation": name, "why": repr(e)})


def _request(
    sessions: dict[int, SessionCache],
    handle: int,
    tokens: list[int],
    keep: int,
    fresh: bool,
    tree: list[int] | None,
) -> ForwardRequest:
    return ForwardRequest(sessions[handle], tokens, keep, fresh, tree)


def _watch_parent(parent: int, rank: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    log.error("tensor-parallel rank 0 is gone; exiting", extra={"rank": rank})
    _exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m specdec.replica.tp`: a follower rank started by rank 0 (`Ranks.start`)."""
    from specdec.common.logs import setup_logging
    from specdec.replica.loading import log_libraries_as_json

    # A stop is rank 0's to order (its "stop", or its exit): a SIGTERM or Ctrl-C sent to
    # the whole process group reaches rank 0, which stops the followers after its forward.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = pickle.loads(base64.b64decode(os.environ[CONFIG_ENV]))
    rank = int(os.environ["RANK"])
    setup_logging(f"{config.role}-rank{rank}")
    log_libraries_as_json()
    follow(config, rank)


if __name__ == "__main__":
    main()
