"""Memory under a long load with cancellations: `python -m specdec.tools.soak`.

Starts Redis, a drafter, a verifier and a gateway (`LocalStack`) on tiny random models
built into --models (or the models given), then drives --concurrency workers through
`AsyncClient` for --duration seconds. Each request takes a random prompt, k in {0, 3},
SSD on or off, and half the time the next turn of one of a few sessions per worker; a
share of them (--cancel-share) is a stream that the client leaves after a random number of
chunks, which cancels the call. Every --sample-every seconds it reads each service's
resident memory (VmRSS); the last sample of the warm-up (--warmup seconds) is the
reference, and growth is the last sample against it.

It prints one JSON object and writes it to --out: requests, cancelled streams, errors by
gRPC status, RSS per service at the end of warm-up and at the end, and growth. Exit code 1
when any error other than a client's own cancel occurred, or when a drafter's or
verifier's RSS grew by more than --max-growth (the gateway's is reported, not judged: its
Python heap holds bounded caches that fill slowly). Bounded by --duration, always.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from specdec.sdk import AsyncClient, SpecdecError
from specdec.tools.stack import LocalStack, add_stack_arguments

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import numpy as np\n",
    "Once upon a time, in a land far away,",
    "class Counter:\n    def __init__(self):",
    "SELECT name, count(*) FROM users",
]
JUDGED = ("drafter", "verifier")
TURNS = 4  # turns of one conversation


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Load:
    def __init__(self, client: AsyncClient, args: argparse.Namespace, seed: int):
        self.client = client
        self.args = args
        self.rng = random.Random(seed)
        self.requests = 0
        self.cancelled = 0
        self.tokens = 0
        self.errors: Counter[str] = Counter()

    async def worker(self, w: int, until: float) -> None:
        # A few conversations per worker; one ends after TURNS turns and a new one starts
        # (its history stays within the tiny models' 512-token context).
        sessions: list[list[Any]] = [[f"soak-{w}-{i}", 0] for i in range(3)]  # [id, turns]
        started = len(sessions)
        while time.monotonic() < until:
            rng = self.rng
            kw: dict[str, Any] = {
                "prompt": rng.choice(PROMPTS),
                "max_new_tokens": rng.randint(4, self.args.max_new_tokens),
                "k": rng.choice((0, 3)),
                "ssd": rng.random() < 0.5,
                "timeout": 120,
            }
            if rng.random() < 0.5:
                conversation = rng.choice(sessions)
                if conversation[1] == TURNS:
                    conversation[:] = [f"soak-{w}-{started}", 0]
                    started += 1
                conversation[1] += 1
                kw["session_id"] = conversation[0]
            self.requests += 1
            try:
                if rng.random() < self.args.cancel_share:
                    leave_after = rng.randint(1, 4)
                    seen = 0
                    async for chunk in self.client.stream(**kw):
                        seen += 1
                        self.tokens += len(chunk.tokens)
                        if seen >= leave_after and not chunk.final:
                            self.cancelled += 1
                            break  # leaving the loop cancels the call
                else:
                    g = await self.client.generate(**kw)
                    self.tokens += len(g.tokens)
            except SpecdecError as e:
                self.errors[e.code.name] += 1


async def soak(args: argparse.Namespace, stack: LocalStack) -> dict:
    pids = {p.name: p.pid for p in stack.procs}
    samples: list[tuple[float, dict[str, float]]] = []
    started = time.monotonic()
    until = started + args.duration
    async with AsyncClient(stack.gateway.address) as client:
        load = Load(client, args, args.seed)
        workers = [asyncio.ensure_future(load.worker(w, until)) for w in range(args.concurrency)]
        while time.monotonic() < until:
            samples.append((time.monotonic() - started, {n: rss_mb(p) for n, p in pids.items()}))
            await asyncio.sleep(min(args.sample_every, max(0.0, until - time.monotonic())))
        await asyncio.gather(*workers)
    samples.append((time.monotonic() - started, {n: rss_mb(p) for n, p in pids.items()}))
    warm = [s for t, s in samples if t <= args.warmup] or [samples[0][1]]
    reference, last = warm[-1], samples[-1][1]
    growth = {n: round(last[n] / reference[n] - 1, 4) for n in pids}
    unexpected = {code: n for code, n in load.errors.items() if code != "CANCELLED"}
    return {
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "concurrency": args.concurrency,
        "requests": load.requests,
        "cancelled_streams": load.cancelled,
        "tokens": load.tokens,
        "errors": dict(load.errors),
        "rss_mb_after_warmup": {n: round(v, 1) for n, v in reference.items()},
        "rss_mb_end": {n: round(v, 1) for n, v in last.items()},
        "rss_growth": growth,
        "rss_samples": [(round(t, 1), {n: round(v, 1) for n, v in s.items()}) for t, s in samples],
        "ok": not unexpected and all(growth[n] < args.max_growth for n in JUDGED),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.soak", description=__doc__)
    p.add_argument("--models", help="tiny models folder (built there when empty; default: temp)")
    p.add_argument("--draft-model", help="draft model (default: the tiny noisy draft)")
    p.add_argument("--target-model", help="target model (default: the tiny target)")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument(
        "--warmup",
        type=float,
        default=300.0,
        help="seconds before the reference (the replicas' KV caches fill to their bound first)",
    )
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cancel-share", type=float, default=0.3, help="share of streams left early")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--max-growth", type=float, default=0.05, help="replica RSS growth allowed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="soak.json", help="where the JSON goes")
    add_stack_arguments(p, port_default=0)
    args = p.parse_args(argv)
    if not 0 < args.warmup < args.duration:
        p.error("--warmup must be in (0, --duration)")
    with tempfile.TemporaryDirectory() as tmp:
        if not (args.draft_model and args.target_model):
            from specdec.tools.tinymodels import build_test_models

            models = build_test_models(Path(args.models or tmp))
            args.draft_model = args.draft_model or str(models.draft_noisy)
            args.target_model = args.target_model or str(models.target)
        args.draft_gguf_file = args.target_gguf_file = None
        with LocalStack(args, announce=lambda line: print(line, file=sys.stderr)) as stack:
            result = asyncio.run(soak(args, stack))
    text = json.dumps(result, indent=2)
    Path(args.out).write_text(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rss_samples"}, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
