"""What one traced span costs, in CPU time: `python -m specdec.tools.bench.spancost`.

Runs the span shapes a speculation round produces (a round span, CLIENT spans with
traceparent injection, a replica SERVER span with context extraction, forward spans) with
the services' own set-up (`setup_tracing`: a batch span processor and the OTLP/gRPC
exporter) against a receiver in this process, and reports CPU seconds (process time, which
the machine's other load disturbs far less than wall time) per span, export included (and, to err on the high side, the receiver's decoding, which runs in
the same process).
Multiplied by the spans per round that `specdec bench --tracing` reports and divided by a
round's time, it bounds what tracing adds to a round on any model pair.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def run(rounds: int) -> dict:
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    from specdec.common import telemetry
    from specdec.tools.otlpsink import OtlpReceiver

    with OtlpReceiver() as receiver:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        # Room for every span, so that all are exported (and counted) rather than dropped.
        os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "1000000")
        tracing = telemetry.setup_tracing("spancost")
        assert tracing is not None  # the endpoint is set just above
        tracer = telemetry.tracer
        spans = 0

        def one_round(i: int) -> int:
            with tracer.start_as_current_span(
                "speculation round", attributes={"specdec.round.index": i, "specdec.round.k": 2}
            ) as round_span:
                for method in ("Draft", "Verify", "Speculate"):
                    with tracer.start_as_current_span(
                        f"specdec.v1.X/{method}",
                        kind=SpanKind.CLIENT,
                        attributes={**telemetry.rpc_attributes("specdec.v1.X", method),
                                    "server.address": "127.0.0.1", "server.port": 1},
                    ) as client:  # fmt: skip
                        carrier = dict(telemetry.outgoing_metadata() or ())
                        with tracer.start_as_current_span(
                            f"specdec.v1.X/{method}",
                            context=propagate.extract(carrier),
                            kind=SpanKind.SERVER,
                            attributes={"specdec.session_id": "s/x", "specdec.k": 2},
                        ) as server:
                            with tracer.start_as_current_span(
                                "forward verify",
                                attributes={"specdec.forward.tokens": 3,
                                            "specdec.forward.batch_size": 1},
                            ):  # fmt: skip
                                pass
                            server.set_attributes({"specdec.cache.result": "hit"})
                        client.set_attribute("rpc.grpc.status_code", 0)
                round_span.set_attributes({"specdec.round.accepted": 2})
            return 1 + 3 * 3

        for i in range(200):  # warm-up
            spans += one_round(i)
        tracing.provider.force_flush()
        warm, spans = spans, 0
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(rounds):
            spans += one_round(i)
        tracing.shutdown()  # the export of every span is in the measured time
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        received = len(receiver.spans()) - warm
    return {
        "spans": spans,
        "received": received,
        "cpu_us_per_span": round(cpu / spans * 1e6, 2),
        "wall_us_per_span": round(wall / spans * 1e6, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2000)
    print(json.dumps(run(p.parse_args().rounds)))


if __name__ == "__main__":
    main()
