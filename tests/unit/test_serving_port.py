"""A service's gRPC port is its own: a port another process holds, even one that allows
sharing it (SO_REUSEPORT, as gRPC servers do by default), is refused with a clear error
instead of being shared (two `specdec up` stacks on one --port each took some of the
connections, silently)."""

from __future__ import annotations

import socket

import pytest

from specdec.common.serving import serve


async def _never() -> None:
    raise AssertionError("a service that cannot listen does not start loading")


@pytest.fixture
def shared_port():
    """A listening socket on a free loopback port that lets others bind it too."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


async def test_a_port_in_use_is_refused_not_shared(shared_port):
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{shared_port}"):
        await serve(
            service_name="specdec.v1.Test",
            add_servicers=lambda server: None,
            reflect=[],
            host="127.0.0.1",
            port=shared_port,
            ready=_never,
            grace_seconds=0.1,
        )
