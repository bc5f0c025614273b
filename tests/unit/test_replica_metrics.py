"""The replica's queue, miss and cache accounting (specdec.replica.metrics), on the real
model-thread scheduler (specdec.replica.batching, plain calls: no model); the runtime is a
stand-in holding only what the observer reads."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from specdec.common.errors import CacheMiss
from specdec.replica.batching import Scheduler
from specdec.replica.metrics import ReplicaObserver, note_cache, note_eviction, note_rollback


def value(name: str, **labels) -> float:
    got = REGISTRY.get_sample_value(name, labels)
    return 0.0 if got is None else got


class _Store:
    """Stands in for CacheStore: the three figures the observer reads."""

    max_cached_tokens = 1000
    cached_tokens = 250

    def __len__(self) -> int:
        return 2


@pytest.fixture
def observer():
    runtime = SimpleNamespace(
        config=SimpleNamespace(role="unitreplica", max_cached_tokens=1000), store=_Store()
    )
    return ReplicaObserver(runtime)


async def test_queue_depth_counts_waiting_and_cancelled_jobs(observer):
    executor = Scheduler("unit-model", max_batch_size=16, max_batch_tokens=2048)
    release, started = threading.Event(), threading.Event()

    def blocking() -> str:
        started.set()
        release.wait(10)
        return "done"

    base = value("specdec_unitreplica_num_requests_waiting")
    first = asyncio.ensure_future(observer.run(executor, blocking))
    await asyncio.to_thread(started.wait, 10)
    assert value("specdec_unitreplica_num_requests_waiting") == base  # running, not waiting
    second = asyncio.ensure_future(observer.run(executor, lambda: "second"))
    third = asyncio.ensure_future(observer.run(executor, lambda: "third"))
    await asyncio.sleep(0.05)
    assert value("specdec_unitreplica_num_requests_waiting") == base + 2
    second.cancel()  # its caller gave up before the model thread reached it
    await asyncio.sleep(0.05)
    assert value("specdec_unitreplica_num_requests_waiting") == base + 1
    release.set()
    assert await first == "done" and await third == "third"
    assert value("specdec_unitreplica_num_requests_waiting") == base
    assert value("specdec_unitreplica_kv_cache_usage_perc") == 0.25
    assert value("specdec_unitreplica_cached_sessions") == 2
    assert value("specdec_unitreplica_max_cached_tokens") == 1000
    executor.shutdown()


async def test_misses_rollbacks_evictions_and_forwards(observer):
    executor = Scheduler("unit-model", max_batch_size=16, max_batch_tokens=2048)
    misses = value("specdec_unitreplica_cache_misses_total")

    def miss():
        raise CacheMiss("cache miss: not here")

    with pytest.raises(CacheMiss):
        await observer.run(executor, miss)
    assert value("specdec_unitreplica_cache_misses_total") == misses + 1

    rollback = value("specdec_unitreplica_cache_rollback_tokens_total")
    evictions = value("specdec_unitreplica_cache_evictions_total")
    count = value("specdec_unitreplica_model_forward_seconds_count", kind="other")

    def job():
        note_cache(12)
        note_rollback(3)
        note_eviction(40)
        with observer.forward(tokens=5, batch=2):
            pass
        with observer.forward(tokens=4, fresh=True):
            pass

    await observer.run(executor, job)
    assert value("specdec_unitreplica_cache_rollback_tokens_total") == rollback + 3
    assert value("specdec_unitreplica_cache_evictions_total") == evictions + 1
    # No RPC set the operation: the forward is "other"; a forward into an empty cache is
    # a prefill whatever the RPC.
    assert value("specdec_unitreplica_model_forward_seconds_count", kind="other") == count + 1
    assert value("specdec_unitreplica_model_forward_batch_size_sum", kind="other") >= 2
    assert value("specdec_unitreplica_model_forward_tokens_sum", kind="prefill") >= 4
    executor.shutdown()
