"""specdec client SDK: sync and asyncio clients for the gateway (torch-free).

    from specdec.sdk import Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("def fibonacci(n):", max_new_tokens=64).text)
        for chunk in client.stream("Once upon a time", k=4):
            print(chunk.text, end="", flush=True)

Imports only grpcio, protobuf, the standard library and the generated ``specdec.v1`` stubs.
"""

from specdec.sdk.client import (
    AsyncClient,
    Client,
    build_generate_request,
    read_token,
    tls_credentials,
)
from specdec.sdk.errors import (
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    InvalidRequest,
    NotFound,
    Reason,
    ResourceExhausted,
    SpecdecError,
    Unavailable,
    Unimplemented,
    from_rpc_error,
)
from specdec.sdk.names import DraftMethod, KPolicy
from specdec.sdk.types import (
    Choice,
    Generation,
    ServerInfo,
    SpeculationStats,
    StreamChunk,
    Timings,
    TokenLogprob,
    Usage,
)

__all__ = [
    "AsyncClient",
    "Choice",
    "Client",
    "DeadlineExceeded",
    "DraftMethod",
    "Generation",
    "InternalError",
    "InvalidArgument",
    "InvalidRequest",
    "KPolicy",
    "NotFound",
    "Reason",
    "ResourceExhausted",
    "ServerInfo",
    "SpecdecError",
    "SpeculationStats",
    "StreamChunk",
    "Timings",
    "TokenLogprob",
    "Unavailable",
    "Unimplemented",
    "Usage",
    "build_generate_request",
    "from_rpc_error",
    "read_token",
    "tls_credentials",
]
