"""Every 5 s: the verifier's and the drafter's reported cost (buckets, load, and the
surface read at a few shapes), one JSON line each, until killed. Usage: poll.py VERIFIER
DRAFTER OUT (gRPC addresses, the output file)."""

import json
import sys
import time

import grpc

from specdec.common.cost import ReportedCost
from specdec.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

SHAPES = [(r, n) for r in (1, 4, 8, 12, 16) for n in (1, 2, 3, 4, 5)]


def report(address: str, stub) -> dict:
    with grpc.insecure_channel(address) as channel:
        info = stub(channel).Info(common_pb2.InfoRequest(), timeout=5)
    cost = ReportedCost.from_proto(info.forward_cost)
    return {
        "buckets": [(edge, line.base_ms, str(line)) for edge, line in cost.buckets],
        "load": str(cost.load),
        "ms": {f"{r}x{n}": round(cost.ms(r, n)) for r, n in SHAPES},
    }


def main() -> None:
    verifier, drafter, out = sys.argv[1:4]
    with open(out, "w") as f:
        while True:
            try:
                record = {
                    "t": time.time(),
                    "v": report(verifier, verifier_pb2_grpc.VerifierServiceStub),
                    "d": report(drafter, drafter_pb2_grpc.DrafterServiceStub),
                }
            except grpc.RpcError as e:
                record = {"err": str(e)}
            f.write(json.dumps(record) + "\n")
            f.flush()
            time.sleep(5)


if __name__ == "__main__":
    main()
