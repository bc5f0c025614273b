"""Fixtures shared by the unit tests: a real redis-server per test (RedisProcess; no mocks)."""

from __future__ import annotations

import pytest
import redis

from specdec.tools.redisproc import RedisProcess


@pytest.fixture
def server():
    """A redis-server of its own on a free loopback port, stopped after the test."""
    proc = RedisProcess()
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def raw(server):
    """A plain (synchronous) client of `server`."""
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()
