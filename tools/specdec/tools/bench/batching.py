"""Aggregate tokens/s of N concurrent sessions, batched across sessions vs one at a time,
measured in one process on one loaded model (so machine load hits both alike).

    python -m specdec.tools.bench.batching MODEL_DIR [--dtype bfloat16] [--threads 1]
        [--sessions 1,2,4,8] [--tokens 16] [--repeats 3] [--mode step|draft] [--k 4]
        [--pack-weights true]

For each N and repeat it prefills N sessions (prompts of different lengths, not timed),
then times N concurrent callers through `ModelRuntime.run`, each taking --tokens tokens:
`step`: one Verify with an empty draft per token (a plain target step, k = 0); `draft`:
Drafts of --k tokens (the drafter's k lock-step forwards); `verify`: a Verify of a
k-token draft per round (the target's side of a k = --k round: k + 1 tokens scored, the
rejected rolled back; the draft repeats the last token, so a round mostly yields one
token; tokens/s counts what the rounds yield). "serial" runs with --max-batch-size 1 (the
scheduler runs one job at a time), "batched" with N. The two alternate within each
repeat. Prints one JSON line per N: tokens/s of each (median over repeats, and every
repeat), their ratio, and the load average before and after.

--engines dense,paged: instead of serial against batched, the KV engines (--engine)
against each other, batched, on the one loaded model (its store swapped between runs),
alternating within each repeat; each line has every engine's tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from specdec.common.prefix import prefix_hash
from specdec.drafter.config import DrafterConfig
from specdec.drafter.proposer import DraftCall, propose
from specdec.drafter.speculate import BranchStore
from specdec.replica.engine import Prefix
from specdec.replica.runtime import ModelRuntime
from specdec.replica.sampling import SamplingParams
from specdec.verifier.scorer import VerifyCall, verify

GREEDY = SamplingParams(temperature=0.0)


def _prompt(i: int, vocab: int) -> list[int]:
    return [(17 * i + 31 * j) % (vocab - 10) + 5 for j in range(24 + 9 * i)]


async def _session(rt: ModelRuntime, sid: str, mode: str, tokens: int, k: int, ctx: list[int]):
    """Generate `tokens` tokens after ctx (the session's cache holds all but its last)."""
    made = 0
    branches = BranchStore()
    while made < tokens:
        prefix = Prefix(len(ctx) - 1, prefix_hash(ctx[:-1]))
        if mode in ("step", "verify"):
            draft = [ctx[-1]] * k if mode == "verify" else []
            v = await rt.run(
                verify, VerifyCall(rt, sid, prefix, ctx[-1:], draft, None, GREEDY), session=sid
            )
            ctx.extend([*draft[: v.accepted], v.next_token])
            made += v.accepted + 1
        else:
            d = await rt.run(
                propose, DraftCall(rt, branches, sid, prefix, ctx[-1:], k, GREEDY), session=sid
            )
            ctx.extend(d.tokens)  # the cache holds all but the last draft token
            made += k


async def _measure(rt: ModelRuntime, n: int, batch: int, a: argparse.Namespace) -> float:
    rt.scheduler.max_batch_size = batch
    contexts = {}
    for i in range(n):  # prefill, not timed
        sid = f"bench-{i}"
        rt.release(sid)
        ctx = _prompt(i, rt.vocab_size)
        await rt.run(
            verify, VerifyCall(rt, sid, Prefix(0, 0), ctx[:-1], [], None, GREEDY), session=sid
        )
        contexts[sid] = ctx  # the cache holds all but its last token
    started = time.perf_counter()
    await asyncio.gather(
        *(_session(rt, sid, a.mode, a.tokens, a.k, ctx) for sid, ctx in contexts.items())
    )
    seconds = time.perf_counter() - started
    for sid in contexts:
        rt.release(sid)
    return n * a.tokens / seconds


async def _engines(rt: ModelRuntime, a: argparse.Namespace) -> None:
    engines = a.engines.split(",")
    for n in map(int, a.sessions.split(",")):
        load = os.getloadavg()[0]
        runs: dict[str, list[float]] = {e: [] for e in engines}
        for _ in range(a.repeats):
            for engine in engines:
                rt.store = rt.new_store(engine)
                runs[engine].append(await _measure(rt, n, n, a))
        row = {"mode": a.mode, "k": a.k if a.mode != "step" else 0, "sessions": n}
        for engine in engines:
            row[f"{engine}_tok_s"] = round(statistics.median(runs[engine]), 1)
        for engine in engines:
            row[f"{engine}_runs"] = [round(x, 1) for x in runs[engine]]
        row["load_before_after"] = [round(load, 2), round(os.getloadavg()[0], 2)]
        print(json.dumps(row), flush=True)


async def _main(a: argparse.Namespace) -> None:
    cfg = DrafterConfig(
        role="drafter",
        model=a.model,
        dtype=a.dtype,
        pack_weights=a.pack_weights,
        threads=a.threads,
        max_batch_size=16,
    )
    rt = ModelRuntime(cfg)
    await rt.run(rt.load, bounded=False)
    await _measure(rt, 2, 2, a)  # warm-up
    if a.engines:
        await _engines(rt, a)
        rt.shutdown()
        return
    for n in map(int, a.sessions.split(",")):
        load = os.getloadavg()[0]
        serial, batched = [], []
        for _ in range(a.repeats):
            serial.append(await _measure(rt, n, 1, a))
            batched.append(await _measure(rt, n, n, a))
        s, b = statistics.median(serial), statistics.median(batched)
        row = {
            "mode": a.mode,
            "sessions": n,
            "serial_tok_s": round(s, 1),
            "batched_tok_s": round(b, 1),
            "ratio": round(b / s, 2),
            "serial_runs": [round(x, 1) for x in serial],
            "batched_runs": [round(x, 1) for x in batched],
            "load_before_after": [round(load, 2), round(os.getloadavg()[0], 2)],
        }
        print(json.dumps(row), flush=True)
    rt.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sessions", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=("step", "draft", "verify"), default="step")
    parser.add_argument("--engines", default="", help="e.g. dense,paged: compare KV engines")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument(
        "--pack-weights", default="false", help="the replicas' --pack-weights (true: packed)"
    )
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
