#!/usr/bin/env python3
"""Container health probe over grpc.health.v1: exit 0 when the service answers SERVING.

Installed in the images as /opt/specdec/bin/specdec-probe and used by their HEALTHCHECK.
Usage: specdec-probe [HOST:PORT [SERVICE]]; the address defaults to 127.0.0.1:$SPECDEC_PORT
(the port the service in the same container listens on) and SERVICE to "" (the whole server).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    port = os.environ.get("SPECDEC_PORT", "")
    address = argv[0] if argv else f"127.0.0.1:{port}"
    service = argv[1] if len(argv) > 1 else ""
    if address.endswith(":") or address.endswith(":0"):
        print("specdec-probe: give HOST:PORT or set SPECDEC_PORT to a fixed port", file=sys.stderr)
        return 2
    timeout = float(os.environ.get("SPECDEC_PROBE_TIMEOUT", "3"))
    request = health_pb2.HealthCheckRequest(service=service)
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
    except grpc.RpcError as e:
        print(f"{address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
