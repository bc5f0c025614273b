"""What one data-plane call costs beyond its job, against how long the caller was idle.

    python -m specdec.tools.bench.callgap [--target-ms 2] [--k 4] [--gaps 0,1,2,4] [--calls 400]
                                          [--transports dataplane,grpcstream,grpc] [--rounds 1]

Starts one stand-in verifier (specdec.tools.bench.standin, a forward of --target-ms) and
sends it Verify calls of --k draft tokens over each transport (its data plane, a unary
gRPC call, as the gateway would: specdec.gateway.fleet.transport, or one bidirectional gRPC
stream: specdec.tools.bench.grpcstream, whose verifier then serves all three), one at a
time, waiting --gaps milliseconds (slept, so the caller's CPU goes idle, as a gateway's
does while the other replica works) before each. Per gap, the transports take turns
--rounds times (--calls split among the turns), so a load that comes and goes on the
machine falls on each alike. Per gap and transport: the median call as the caller
measured it, the job as the replica measured it (VerifyResponse.forward_ms), and the
difference (transport, the replica's handling, the wake-ups of both ends). In a plain
speculation round each replica is idle while the other works, so its calls are the ones
with a gap.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.callgap")
    p.add_argument("--target-ms", type=float, default=2.0, help="the stand-in's forward (ms)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per Verify")
    p.add_argument("--gaps", default="0,1,2,4", help="idle time before each call (ms)")
    p.add_argument("--calls", type=int, default=400, help="calls per gap (the first 50 warm up)")
    p.add_argument(
        "--transports", default="dataplane", help="dataplane, grpc, grpcstream (comma-separated)"
    )
    p.add_argument("--rounds", type=int, default=1, help="turns of the transports per gap")
    args = p.parse_args(argv)
    names = [name.strip() for name in args.transports.split(",")]

    import sys

    import grpc
    import uvloop

    from specdec.common.prefix import PrefixChain
    from specdec.gateway.fleet.dataplane import DataPlaneTransport
    from specdec.gateway.fleet.transport import GrpcTransport, Method, Transport
    from specdec.tools.bench.grpcstream import StreamTransport
    from specdec.tools.bench.standin import build_standins
    from specdec.tools.launcher import ServiceProcess
    from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

    models = build_standins(Path(tempfile.mkdtemp(prefix="specdec-callgap-")), args.target_ms)
    flags = ("--model", str(models.target), "--port", "0", "--host", "127.0.0.1",
             "--trust-remote-code", "true", "--threads", "1")  # fmt: skip
    if "grpcstream" in names:  # the verifier that also serves the stream
        module = [sys.executable, "-m", "specdec.tools.bench.grpcstream"]
        verifier = ServiceProcess("verifier", [*module, *flags])
    else:
        verifier = ServiceProcess.specdec("verifier", "serve", "verifier", *flags)

    async def measure() -> None:
        channel = grpc.aio.insecure_channel(verifier.address)
        stub = verifier_pb2_grpc.VerifierServiceStub(channel)
        info = await stub.Info(common_pb2.InfoRequest())
        transports: dict[str, Transport] = {
            "dataplane": DataPlaneTransport("127.0.0.1", info.data_port),
            "grpc": GrpcTransport(stub),
            "grpcstream": StreamTransport(channel),
        }
        print("| transport | idle before a call | call | its job | beyond the job |")
        print("| --- | --: | --: | --: | --: |")
        per_turn = max(1, args.calls // args.rounds)
        for gap in [float(g) for g in args.gaps.split(",")]:
            times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
            for _ in range(args.rounds):
                for name in names:
                    calls, jobs = times[name]
                    await timed(transports[name], gap, per_turn, calls, jobs, f"{name}-{gap}")
            for name in names:
                call, job = (statistics.median(t) for t in times[name])
                print(
                    f"| {name} | {gap:g} ms | {call:.3f} ms | {job:.3f} ms | {call - job:.3f} ms |"
                )
        for name in names:
            await transports[name].close()
        await channel.close()

    async def timed(transport, gap: float, n: int, calls: list, jobs: list, session: str) -> None:
        """n Verify calls after `gap` ms idle each: their times and jobs (ms) added to
        calls and jobs (the first 50 of the first turn warm up and are left out)."""
        ctx, chain, cached = [5, 6, 7], PrefixChain(), 0
        warm = len(calls) == 0
        for i in range(n):
            if len(ctx) > 400:
                ctx, chain, cached = [5, 6, 7], PrefixChain(), 0
            time.sleep(gap / 1e3)
            request = verifier_pb2.VerifyRequest(
                session_id=f"s/{session}",
                prefix=common_pb2.CachedPrefix(length=cached, hash=chain.hash(ctx, cached)),
                new_tokens=ctx[cached:],
                draft_tokens=[9] * args.k,
                sampling=common_pb2.SamplingParams(),
            )
            started = time.perf_counter()
            r = await transport.call(Method.VERIFY, request, 30)
            if i >= 50 or not warm:
                calls.append((time.perf_counter() - started) * 1e3)
                jobs.append(r.forward_ms)
            ctx += [9] * r.accepted_count + [r.next_token]
            cached = r.cached_length

    try:
        verifier.start().wait_healthy()
        uvloop.run(measure())
    finally:
        verifier.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
