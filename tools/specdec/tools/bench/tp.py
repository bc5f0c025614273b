"""A verifier of one rank against one of N ranks (--tensor-parallel N), Verify by Verify.

    python -m specdec.tools.bench.tp MODEL [--ranks 2] [--steps 24] [--k 3]
        [more verifier flags, e.g. --max-cached-tokens 4096]

Starts both verifiers on loopback, then grows one session on each with the same Verify
calls (the accepted drafts and the next token of each verdict appended), the two
alternating step by step so that a shared machine's load falls on both alike. The drafts
are fixed tokens, so most are rejected: every step is a forward of k + 1 tokens and a
rollback. Asserts the two grew the same tokens (exact against one rank) and prints one
JSON line: each verifier's median and 90th-percentile Verify time in ms, after 4 warm-up
steps. Each rank gets the verifier's --threads (SPECDEC_THREADS): N ranks use N times the
CPU threads of one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import grpc

from specdec.common.prefix import prefix_hash
from specdec.tools.launcher import ServiceProcess
from specdec.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

WARM_UP = 4
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def verifier(model: str, *flags: str) -> ServiceProcess:
    return ServiceProcess.specdec(
        "verifier",
        *("serve", "verifier", "--model", model, "--port", "0", "--host", "127.0.0.1"),
        *flags,
    ).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--k", type=int, default=3)
    a, flags = parser.parse_known_args()  # the rest: more verifier flags
    a.flags = [f for f in flags if f != "--"]
    procs = {
        1: verifier(a.model, *a.flags),
        a.ranks: verifier(a.model, "--tensor-parallel", str(a.ranks), *a.flags),
    }
    try:
        for p in procs.values():
            p.wait_healthy(timeout=600)
        channels = {n: grpc.insecure_channel(p.address) for n, p in procs.items()}
        stubs = {n: verifier_pb2_grpc.VerifierServiceStub(c) for n, c in channels.items()}
        seqs = {n: list(PROMPT) for n in procs}
        cached = dict.fromkeys(procs, 0)
        times: dict[int, list[float]] = {n: [] for n in procs}
        drafts = list(range(20, 20 + a.k))
        for step in range(a.steps):
            order = sorted(procs) if step % 2 == 0 else sorted(procs, reverse=True)
            for n in order:
                seq = seqs[n]
                request = verifier_pb2.VerifyRequest(
                    session_id=f"tp-bench-{n}",
                    prefix=common_pb2.CachedPrefix(
                        length=cached[n], hash=prefix_hash(seq[: cached[n]])
                    ),
                    new_tokens=seq[cached[n] :],
                    draft_tokens=drafts,
                )
                started = time.perf_counter()
                verdict = stubs[n].Verify(request, timeout=600)
                if step >= WARM_UP:
                    times[n].append((time.perf_counter() - started) * 1e3)
                seq += [*drafts[: verdict.accepted_count], verdict.next_token]
                cached[n] = len(seq) - 1
        one, many = seqs[1], seqs[a.ranks]
        assert one == many, f"{a.ranks} ranks grew other tokens than one rank"
        out = {"model": a.model, "k": a.k, "tokens": len(one), "exact": True}
        for n, ms in times.items():
            ms.sort()
            out[f"ranks_{n}"] = {
                "median_ms": round(statistics.median(ms), 1),
                "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 1),
                "verifies": len(ms),
            }
        print(json.dumps(out))
        for c in channels.values():
            c.close()
    finally:
        for p in procs.values():
            p.stop()


if __name__ == "__main__":
    main()
