"""An in-process data-plane peer for tests of the protocol: the replica's end of one
connection (its preface, its frames, pongs, replies from a handler) over a socket pair, so
a test drives the gateway's real DataPlaneTransport without a replica process or a TCP
port. `FakeReplica.connector` is the transport's connector: each connection it makes is a
new socket pair served by this peer.

The peer is scripted through its switches: `answering` (False: it reads on and sends
nothing more, not even pongs, and keeps the socket open: a stopped process),
`reading` (cleared: it stops reading the socket, so the gateway's writes back up), and
`refuse` (connection attempts fail with ConnectionRefusedError while it is above 0).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from specdec.common.frames import PREFACE, FrameReader, encode
from specdec.v1 import dataplane_pb2

# A call -> its reply (None: no reply).
Handler = Callable[[dataplane_pb2.DataCall], dataplane_pb2.DataReply | None]


class FakeReplica:
    def __init__(self, handler: Handler | None = None, preface: bytes = PREFACE):
        self.handler = handler or (lambda call: None)
        self.preface = preface
        self.answering = True
        self.reading = asyncio.Event()
        self.reading.set()
        self.refuse = 0  # connection attempts still to refuse
        self.attempts = 0  # connection attempts made, refused ones included
        self.calls: list[dataplane_pb2.DataCall] = []  # every call received (pings too)
        self.received = 0  # bytes read from the gateway
        self.connected = asyncio.Event()  # set at each connection made
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: list[asyncio.Task] = []

    async def connector(self, factory):
        self.attempts += 1
        if self.refuse > 0:
            self.refuse -= 1
            raise ConnectionRefusedError(f"refused (attempt {self.attempts})")
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        self._writers.append(writer)
        self._tasks.append(asyncio.ensure_future(self._serve(reader, writer)))
        loop = asyncio.get_running_loop()
        made = await loop.create_connection(factory, sock=theirs)
        self.connected.set()
        return made

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(self.preface)
        frames = FrameReader()
        while True:
            await self.reading.wait()
            data = await reader.read(64 * 1024)
            if not data:
                return
            self.received += len(data)
            for payload in frames.feed(data):
                call = dataplane_pb2.DataCall.FromString(payload)
                self.calls.append(call)
                if not self.answering:
                    continue
                if call.WhichOneof("call") == "ping":
                    reply = dataplane_pb2.DataReply(id=call.id, pong=call.ping)
                else:
                    reply = self.handler(call)
                if reply is not None:
                    self.send(reply)

    def send(self, reply: dataplane_pb2.DataReply) -> None:
        """Write a reply on the latest connection."""
        self._writers[-1].write(encode(reply.SerializeToString()))

    def drop(self) -> None:
        """Close the latest connection (the replica closed it)."""
        self._writers[-1].close()

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
