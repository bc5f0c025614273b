"""`specdec bench --overhead`: what the stack itself costs per speculation round.

On a GPU a target step takes 5-30 ms, and the gateway, the RPCs and the services' own
Python are what decide whether speculation pays there. This measures that cost without a
GPU: the drafter and the verifier serve stand-in models (specdec.tools.bench.standin_model)
whose every forward takes a known time (``--target-ms``, ``--draft-ms``, plus
``--target-per-token-ms``, ``--draft-per-token-ms`` per row and token for a compute-bound
device) and whose drafter agrees with the target at a set share of positions
(``--acceptance``). With ``--standin-period P`` the target's output cycles through P
tokens, off the cycle at a ``--standin-noise`` share of positions, which sets the
acceptance of lookup drafts (``--gateway-arg '--method ngram'``): the prompts are then cut
to the shortest one's length and mapped onto tokens outside the cycle, and noise starts one
period after them (see standin_model).

Two runs of the same greedy requests:

- **in-process**: both stand-ins in this process, driven by the replicas' own jobs
  (`propose`, `verify`) through `ModelRuntime.drive`, with no thread, RPC or gateway: the
  model work of a round and nothing else a stack could avoid;
- **the stack**: Redis, drafter, verifier and gateway as processes on loopback (the
  local stack of `specdec up`), the requests sent through the SDK, at each concurrency of
  ``--concurrency`` (that many sessions at once, each sending its requests in turn). Its
  gateway drafts k tokens with the model every round (``--method model --k-policy
  fixed``, as in-process) unless a ``--gateway-arg`` names another method or policy.

A round's time is measured in the steady state: from the first round's end to the last
round's end, over the rounds in between (the first round prefills the prompt; the request's
own set-up and RPC are not a round's). In the stack that is the gateway's own clock
(`Timings.total_ms - time_to_first_token_ms`), in-process the same span of the loop.
Per round, ``overhead = stack time - in-process time`` of the same draft length. A round
with SSD is compared with the in-process Verify plus the in-process Draft of the rounds
that missed (a hit's draft was prepared while the verifier worked, so its drafting is off
the critical path). The k = 0 stack is also compared end to end (the client's clock,
tokens per second) with `transformers`' `generate` on the same stand-in in this process:
the target alone, as `specdec bench` measures every speedup. The report also projects what the overhead keeps of speculation's
speedup at GPU step times (``--project``): with step T, draft cost ratio c (draft_ms /
target_ms), E tokens per round and overhead o, plain speculation gives E T / (T (1 + k c)
+ o) against the target alone at T per token, SSD E T / (T (1 + m k c) + o) with m its
miss share.

Every stack output is compared token for token with the in-process target alone.

``--profile DIR`` also samples the gateway, the drafter and the verifier with py-spy while
one more pass of the k=0 and the largest-k modes runs, and writes each process's collapsed
stacks and top frames.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Mode:
    k: int
    ssd: bool = False

    @property
    def name(self) -> str:
        return f"ssd k={self.k}" if self.ssd else f"k={self.k}"


@dataclass
class Tally:
    """Requests of one mode and concurrency: steady-state round time, tokens, SSD
    outcomes, and the client's end-to-end time."""

    requests: int = 0
    steady_seconds: float = 0.0  # summed over requests: after the first round
    steady_rounds: int = 0  # rounds after the first
    wall_seconds: float = 0.0  # the client's clock, summed over requests
    rounds: int = 0
    tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    ssd_hits: int = 0
    ssd_misses: int = 0
    exact: bool = True
    per_request_ms_per_round: list[float] = field(default_factory=list)

    def add(self, wall: float, result, exact: bool) -> None:
        s, t = result.stats, result.timings
        steady = (t.total_ms - t.time_to_first_token_ms) / 1e3
        self.requests += 1
        self.wall_seconds += wall
        self.steady_seconds += steady
        self.steady_rounds += s.rounds - 1
        self.rounds += s.rounds
        self.tokens += len(result.tokens)
        self.draft_tokens += s.draft_tokens
        self.accepted_tokens += s.accepted_tokens
        self.ssd_hits += s.ssd_hits
        self.ssd_misses += s.ssd_misses
        self.exact &= exact
        self.per_request_ms_per_round.append(steady / max(1, s.rounds - 1) * 1e3)

    @property
    def ms_per_round(self) -> float:
        return self.steady_seconds / self.steady_rounds * 1e3

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_seconds

    @property
    def miss_share(self) -> float:
        n = self.ssd_hits + self.ssd_misses
        return self.ssd_misses / n if n else 1.0


# -- in-process ---------------------------------------------------------------------------


class InProcess:
    """Both stand-ins in this process, driven by the replicas' own jobs without threads."""

    def __init__(self, draft_model: Path, target_model: Path):
        from specdec.drafter.config import DrafterConfig
        from specdec.drafter.runtime import DrafterRuntime
        from specdec.drafter.speculate import BranchStore
        from specdec.replica.runtime import ModelRuntime
        from specdec.verifier.config import VerifierConfig

        common: dict[str, Any] = dict(trust_remote_code=True, threads=1, max_batch_size=1)
        self.drafter = DrafterRuntime(
            DrafterConfig(role="drafter", model=str(draft_model), **common)
        )
        self.verifier = ModelRuntime(
            VerifierConfig(role="verifier", model=str(target_model), **common)
        )
        for rt in (self.drafter, self.verifier):
            rt.load()
            rt.shutdown()  # jobs run here (drive), not on the model thread
        self.branches = BranchStore()
        self._sessions = 0

    def generate(self, prompt: list[int], n: int, k: int) -> tuple[list[int], dict]:
        """Greedy speculation of n tokens at draft length k: the tokens, and the steady
        state (every round but the first): its seconds drafting and verifying, its rounds,
        and its whole time."""
        from specdec.common.params import SamplingParams
        from specdec.common.prefix import PrefixChain
        from specdec.drafter.proposer import DraftCall, propose
        from specdec.replica.engine import Prefix
        from specdec.v1 import common_pb2
        from specdec.verifier.scorer import VerifyCall, verify

        params = SamplingParams.from_proto(common_pb2.SamplingParams())
        self._sessions += 1
        session = f"r/inproc-{self._sessions}"
        ctx, chain = list(prompt), PrefixChain()
        out: list[int] = []
        steady = {"draft": 0.0, "verify": 0.0, "rounds": 0, "seconds": 0.0}
        d_cached = v_cached = 0
        first_end: float | None = None
        while len(out) < n:
            kk = min(k, n - len(out) - 1)
            draft: list[int] = []
            t0 = time.perf_counter()
            if kk:
                prefix = Prefix(d_cached, chain.hash(ctx, d_cached))
                job = propose(
                    DraftCall(
                        self.drafter, self.branches, session, prefix, ctx[d_cached:], kk, params
                    )
                )
                d = self.drafter.drive(job)
                draft, d_cached = d.tokens, d.cached_length
            t1 = time.perf_counter()
            prefix = Prefix(v_cached, chain.hash(ctx, v_cached))
            v = self.verifier.drive(
                verify(
                    VerifyCall(self.verifier, session, prefix, ctx[v_cached:], draft, None, params)
                )
            )
            t2 = time.perf_counter()
            new = [*draft[: v.accepted], v.next_token]
            d_cached = min(d_cached, len(ctx) + v.accepted)
            v_cached = v.cached_length
            ctx += new
            out += new
            if first_end is None:
                first_end = time.perf_counter()
            else:
                steady["draft"] += t1 - t0
                steady["verify"] += t2 - t1
                steady["rounds"] += 1
        assert first_end is not None  # n > 0: a round ran
        steady["seconds"] = time.perf_counter() - first_end
        self.drafter.release(session)
        self.verifier.release(session)
        return out[:n], steady


def _generate_tps(model_dir: Path, prompts, n: int, reference) -> float:
    """`transformers` generate (greedy) on the stand-in target in this process, tokens per
    second over the prompts: the target alone, the baseline of every specdec speedup. Its
    output must be the in-process loop's (a check of both)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True).eval()
    tokens, seconds = 0, 0.0
    for ids in prompts:
        x = torch.tensor([ids])
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n
            )
        seconds += time.perf_counter() - started
        got = out[0, len(ids) :].tolist()
        if got != reference[tuple(ids)]:
            raise RuntimeError("generate() and the in-process loop differ on the stand-in")
        tokens += len(got)
    return tokens / seconds


# -- the stack ----------------------------------------------------------------------------


def _run_stack_mode(
    address: str,
    mode: Mode,
    prompts,
    n,
    concurrency,
    requests,
    reference,
    tally: Tally | None = None,
    offset: int = 0,
) -> Tally:
    """`concurrency` sessions at once, each sending `requests` requests in turn (session i's
    j-th request takes prompt i + j + offset), added to `tally`."""
    from specdec.sdk import Client

    tally = tally if tally is not None else Tally()
    lock = threading.Lock()
    errors: list[BaseException] = []

    def session(i: int) -> None:
        try:
            with Client(address, timeout=600) as client:
                for j in range(requests):
                    ids = prompts[(i + j + offset) % len(prompts)]
                    started = time.perf_counter()
                    r = client.generate(token_ids=ids, max_new_tokens=n, k=mode.k, ssd=mode.ssd)
                    wall = time.perf_counter() - started
                    with lock:
                        tally.add(wall, r, list(r.tokens) == reference[tuple(ids)])
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return tally


@contextlib.contextmanager
def _profiled(procs, out: Path, seconds: float, tag: str):
    """py-spy samples each process while the block runs (collapsed stacks per process)."""
    out.mkdir(parents=True, exist_ok=True)
    spies = [
        subprocess.Popen(
            [
                _py_spy(),
                "record",
                "--pid",
                str(p.proc.pid),
                "--duration",
                str(int(seconds)),
                "--rate",
                "1000",
                "--format",
                "raw",
                "--nonblocking",
                "--output",
                str(out / f"{tag}-{p.name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for p in procs
    ]
    time.sleep(0.5)  # attached before the requests start
    try:
        yield
    finally:
        for spy in spies:
            _, err = spy.communicate()
            if spy.returncode:
                raise RuntimeError(f"py-spy failed: {err.decode()[-500:]}")


def _py_spy() -> str:
    """The py-spy binary (the dev extra installs it beside this interpreter)."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if not found:
        raise RuntimeError("--profile needs py-spy (pip install py-spy; `make install` has it)")
    return found


# Frames where a thread waits rather than works (py-spy counts some waits in C as active):
# the event loops' and the model thread's polls, a blocked queue, and the stand-in's timed
# wait, which is the model's forward.
WAITS = ("EpollSelector.select", "Runner.run", "Condition.wait", "Poller.select")


def top_frames(path: Path, n: int = 15) -> dict:
    """From py-spy's collapsed stacks: the share of samples in each frame at the top of
    the stack (self) and anywhere in it (inclusive), over all samples; and the self shares
    of the samples that were neither waiting (WAITS) nor the stand-in's forward: where
    the stack's own time goes."""
    self_counts: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        c = int(count)
        total += c
        frames = [_frame(f) for f in stack.split(";")]
        self_counts[frames[-1]] += c
        for f in set(frames):
            inclusive[f] += c
    working = Counter(
        {
            f: c
            for f, c in self_counts.items()
            if not f.startswith(WAITS) and not f.startswith("wait (")
        }
    )
    busy = sum(working.values())

    def share(counter: Counter[str], of: int) -> list[tuple[str, float]]:
        return [(f, round(c / of, 4)) for f, c in counter.most_common(n)] if of else []

    return {
        "samples": total,
        "self": share(self_counts, total),
        "inclusive": share(inclusive, total),
        "working_samples": busy,
        "working_self": share(working, busy),
    }


def _frame(text: str) -> str:
    """'fn (path/to/file.py:12)' -> 'fn (file.py)': one entry per function."""
    name, _, where = text.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    parts = file.split("/")
    return f"{name} ({'/'.join(parts[-2:])})"


# -- the run --------------------------------------------------------------------------------


def run_overhead(args: argparse.Namespace) -> int:
    from specdec.tools.bench.modes import load_prompts
    from specdec.tools.bench.standin import build_standins
    from specdec.tools.costreport import machine
    from specdec.tools.launcher import ServiceFailed
    from specdec.tools.stack import LocalStack
    from specdec.tools.tinymodels import _build_tokenizer

    ks = [int(x) for x in (args.k or "0,1,4").split(",") if x.strip()]
    ssd_ks = [
        int(x) for x in (args.ssd_k if args.ssd_k is not None else "1,4").split(",") if x.strip()
    ]
    concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    project = [float(x) for x in args.project.split(",") if x.strip()]
    modes = [Mode(k) for k in sorted(set([0, *ks]))] + [Mode(k, True) for k in ssd_ks if k > 0]
    n = args.max_new_tokens
    host = machine()
    workdir = Path(tempfile.mkdtemp(prefix="specdec-overhead-"))
    options = standin_options(args)
    tokenizer = _build_tokenizer()  # the stand-ins' own
    prompts = [tokenizer(p.text).input_ids for p in load_prompts(None) if p.text]
    if options["period"]:
        # Prompts of one length (the shortest), so that noise starts right after one clean
        # period of every output; made of tokens no lookup in the output matches.
        shortest = min(map(len, prompts))
        prompts = [ids[:shortest] for ids in prompts]
        options["noise_start"] = shortest + options["period"]
    models = build_standins(workdir, args.target_ms, args.draft_ms, args.acceptance, **options)
    if models.period:
        prompts = [models.prompt_ids(ids) for ids in prompts]

    print(
        f"in-process: stand-ins of {args.target_ms} ms (target) and {args.draft_ms} ms (draft)",
        flush=True,
    )
    local = InProcess(models.draft, models.target)
    reference: dict[tuple, list[int]] = {}
    inproc: dict[int, dict] = {}
    some = prompts[: max(1, min(len(prompts), args.in_process_prompts))]
    for k in sorted({m.k for m in modes}):
        total = {"draft": 0.0, "verify": 0.0, "rounds": 0, "seconds": 0.0}
        for p in range(max(1, args.requests)):
            for ids in some:
                out, steady = local.generate(ids, n, k)
                for key in total:
                    total[key] += steady[key]
                if k == 0 and p == 0:
                    reference[tuple(ids)] = out
                elif k and out != reference.get(tuple(ids), out):
                    raise RuntimeError(f"in-process k={k} differs from k=0 (a bug in the loop)")
        rounds = total["rounds"]
        inproc[k] = {
            "ms_per_round": total["seconds"] / rounds * 1e3,
            "draft_ms_per_round": total["draft"] / rounds * 1e3,
            "verify_ms_per_round": total["verify"] / rounds * 1e3,
            "rounds": rounds,
        }
        print(f"  k={k}: {inproc[k]['ms_per_round']:.3f} ms/round", flush=True)
    for ids in prompts:  # every prompt's reference (the target alone, in-process)
        if tuple(ids) not in reference:
            reference[tuple(ids)] = local.generate(ids, n, 0)[0]
    generate_tps = _generate_tps(models.target, some, n, reference)
    print(f"  transformers generate: {generate_tps:.1f} tokens/s", flush=True)

    # The drafter's k tokens every round, as in-process: the gateway's default method
    # (hybrid) extends a draft by lookups, which on the stand-ins' repeating output verify
    # several times k tokens a round, and its default policy (adaptive) takes k as a bound.
    # A --gateway-arg naming either comes later and wins.
    gateway_args = ["--method model --k-policy fixed", *args.gateway_args]
    stack_args = standin_stack_args(
        models, max(m.k for m in modes), args.log_dir, args.drafter_args,
        args.verifier_args, gateway_args,
    )  # fmt: skip
    results: dict[str, dict] = {}
    profiles: dict[str, dict] = {}
    try:
        with LocalStack(stack_args, announce=print) as stack:
            address = stack.gateway.address
            for m in modes:  # warm-up
                _run_stack_mode(address, m, prompts, 8, 1, 1, {tuple(p): None for p in prompts})
            for c in concurrency:
                # Every mode's requests interleaved, the order rotating: drift of the machine
                # hits the modes alike.
                tallies = {m: Tally() for m in modes}
                for rep in range(max(1, args.requests)):
                    for m in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
                        _run_stack_mode(
                            address, m, prompts, n, c, 1, reference, tallies[m], offset=rep
                        )
                for m, tally in tallies.items():
                    row = _row(m, c, tally, inproc, args)
                    row["vs_generate"] = round(row["tokens_per_second"] / generate_tps, 4)
                    results[f"{m.name} c={c}"] = row
                    print(
                        f"  {m.name:<9} c={c}: {row['ms_per_round']:.3f} ms/round, overhead "
                        f"{row['overhead_ms']:.3f} ms, exact {row['exact']}",
                        flush=True,
                    )
            if args.profile:
                procs = [stack.gateway, stack.drafter, stack.verifier]
                for m in (modes[0], max((x for x in modes if not x.ssd), key=lambda x: x.k)):
                    tag = m.name.replace(" ", "").replace("=", "")
                    profile_dir = Path(args.profile)
                    with _profiled(procs, profile_dir, args.profile_seconds, tag):
                        until = time.perf_counter() + args.profile_seconds - 1
                        while time.perf_counter() < until:
                            _run_stack_mode(address, m, prompts, n, 1, 1, reference)
                    for proc in procs:
                        profiles[f"{m.name} {proc.name}"] = top_frames(
                            profile_dir / f"{tag}-{proc.name}.txt"
                        )
    except ServiceFailed as e:
        print(f"specdec bench --overhead: {e}", file=sys.stderr)
        return 1
    result = {
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "specdec " + shlex.join(sys.argv[1:]),
            "machine": host,
            "target_ms": args.target_ms,
            "draft_ms": args.draft_ms,
            "acceptance": args.acceptance,
            "target_per_token_ms": models.target_per_token_ms,
            "draft_per_token_ms": models.draft_per_token_ms,
            "period": models.period,
            "noise": models.noise,
            "noise_start": models.noise_start,
            "noise_share": _noise_share(models, prompts, n),
            "max_new_tokens": n,
            "requests_per_session": args.requests,
            "in_process": inproc,
            "generate_tokens_per_second": round(generate_tps, 3),
        },
        "modes": results,
        "projections": _projections(results, args, project),
        "profiles": profiles,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "overhead.md").write_text(render(result))
    print(render(result))
    return 0 if all(r["exact"] for r in results.values()) else 1


def standin_stack_args(
    models, default_k: int, log_dir, drafter_args, verifier_args, gateway_args
) -> argparse.Namespace:
    """The arguments of a LocalStack (`specdec up`) serving the stand-ins `models` on
    loopback, one thread per replica."""
    return argparse.Namespace(
        draft_model=str(models.draft), target_model=str(models.target), draft_gguf_file=None,
        target_gguf_file=None, port=0, host="127.0.0.1", dtype="float32", device="cpu",
        draft_threads=1, target_threads=1, draft_cpus=None, target_cpus=None,
        default_k=default_k, ssd=False, log_dir=log_dir,
        replica_flags=["--trust-remote-code"], drafter_flags=[],
        drafter_args=drafter_args, verifier_args=verifier_args, gateway_args=gateway_args,
    )  # fmt: skip


def standin_options(args: argparse.Namespace) -> dict:
    """build_standins' options from the stand-in flags (declared with the others in
    tools/specdec/tools/bench/cli.py; their defaults where a namespace lacks them)."""
    return {
        "target_per_token_ms": getattr(args, "target_per_token_ms", 0.0),
        "draft_per_token_ms": getattr(args, "draft_per_token_ms", 0.0),
        "period": getattr(args, "standin_period", 0),
        "noise": getattr(args, "standin_noise", 0.0),
    }


def _noise_share(models, prompts, n: int) -> float | None:
    """The share of the outputs' positions after noise_start where the stand-in target
    leaves its cycle (None without a period): the realised `noise` of these requests."""
    if not models.period:
        return None
    from specdec.tools.bench import standin_model

    cfg = standin_model.StandinConfig.from_pretrained(models.target)
    inputs = [p for ids in prompts for p in range(len(ids) - 1, len(ids) - 1 + n)]
    after = [p for p in inputs if p >= cfg.noise_start]
    return (
        round(sum(standin_model.is_noise(cfg, p) for p in after) / len(after), 4) if after else 0.0
    )


def _row(m: Mode, c: int, t: Tally, inproc: dict, args) -> dict:
    base = inproc[m.k]
    ideal = base["ms_per_round"]
    if m.ssd:  # hits drafted while the verifier worked: only misses draft on the path
        ideal = base["verify_ms_per_round"] + t.miss_share * base["draft_ms_per_round"]
    return {
        "k": m.k,
        "ssd": m.ssd,
        "concurrency": c,
        "requests": t.requests,
        "rounds": t.rounds,
        "ms_per_round": round(t.ms_per_round, 4),
        "ms_per_round_median_request": round(statistics.median(t.per_request_ms_per_round), 4),
        "in_process_ms_per_round": round(ideal, 4),
        "overhead_ms": round(t.ms_per_round - ideal, 4),
        # The round of c sessions is one batched forward: the stack's cost per session.
        "overhead_per_session_ms": round((t.ms_per_round - ideal) / c, 4),
        "tokens_per_round": round(t.tokens_per_round, 4),
        "acceptance_rate": round(t.accepted_tokens / t.draft_tokens, 4) if t.draft_tokens else None,
        "ssd_hit_rate": round(1 - t.miss_share, 4) if m.ssd else None,
        "vs_in_process": round(ideal / t.ms_per_round, 4),
        "tokens_per_second": round(t.tokens_per_second, 3),
        "exact": t.exact,
    }


def _projections(results: dict, args, steps: list[float]) -> list[dict]:
    """What each c=1 mode's overhead keeps of its speedup at GPU step times."""
    c = args.draft_ms / args.target_ms
    rows = []
    for name, r in results.items():
        if r["concurrency"] != min(x["concurrency"] for x in results.values()):
            continue
        e, k, o = r["tokens_per_round"], r["k"], r["overhead_ms"]
        m = (1 - r["ssd_hit_rate"]) if r["ssd"] else 1.0
        for step in steps:
            rows.append(
                {
                    "mode": name.rsplit(" c=", 1)[0],
                    "step_ms": step,
                    "ideal_speedup": round(e / (1 + m * k * c), 3),
                    "loop_speedup": round(e * step / (step * (1 + m * k * c) + o), 3),
                }
            )
    return rows


def _per_token(meta: dict) -> str:
    t, d = meta.get("target_per_token_ms", 0.0), meta.get("draft_per_token_ms", 0.0)
    return f" plus {t} ms and {d} ms per row and token" if t or d else ""


def _cycle(meta: dict) -> str:
    if not meta.get("period"):
        return ""
    return (
        f"; the output cycles through {meta['period']} tokens, off the cycle (noise) at "
        f"{meta['noise']:.0%} of positions from {meta['noise_start']} "
        f"({meta['noise_share']:.0%} of these outputs')"
    )


def render(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# Overhead of the stack per speculation round",
        "",
        f"`{meta['command']}` on {meta['date'][:10]}: {meta['machine']['cpu']} "
        f"({meta['machine']['cpus']} CPUs). Stand-in forwards of {meta['target_ms']} ms (target) "
        f"and {meta['draft_ms']} ms (draft){_per_token(meta)}, acceptance "
        f"{meta['acceptance']:.0%} by construction{_cycle(meta)}, greedy, "
        f"{meta['max_new_tokens']} tokens per request. Rounds in the "
        "steady state (after the first); `transformers` generate on the same stand-in in "
        f"one process: {meta['generate_tokens_per_second']:.1f} tokens/s.",
        "",
        "| mode | sessions | ms / round | in-process | overhead ms | per session | stack / in-process | tokens / round | SSD hits | tokens/s | vs generate | exact |",
        "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --- |",
    ]  # fmt: skip
    for name, r in result["modes"].items():
        hits = "" if r["ssd_hit_rate"] is None else f"{r['ssd_hit_rate']:.0%}"
        lines.append(
            f"| {name.rsplit(' c=', 1)[0]} | {r['concurrency']} | {r['ms_per_round']:.3f} | "
            f"{r['in_process_ms_per_round']:.3f} | {r['overhead_ms']:.3f} | "
            f"{r['overhead_per_session_ms']:.3f} | "
            f"{r['vs_in_process']:.2f}x | {r['tokens_per_round']:.2f} | {hits} | "
            f"{r['tokens_per_second']:.1f} | {r['vs_generate']:.2f}x | "
            f"{'yes' if r['exact'] else 'NO'} |"
        )
    lines += [
        "",
        "What the c=1 overhead keeps at GPU step times (draft cost ratio "
        f"c = {meta['draft_ms'] / meta['target_ms']:.3f}, the stand-ins' tokens per round):",
        "",
        "| mode | step ms | speculation alone | with this loop |",
        "| --- | --: | --: | --: |",
    ]
    for p in result["projections"]:
        lines.append(
            f"| {p['mode']} | {p['step_ms']:g} | {p['ideal_speedup']:.2f}x | {p['loop_speedup']:.2f}x |"
        )
    for name, prof in result.get("profiles", {}).items():
        working = prof.get("working_samples", 0)
        lines += [
            "",
            f"## py-spy: {name} ({prof['samples']} samples, {working} working)",
            "",
            "Top frames by own samples; right: of the samples that neither wait (event loop, "
            "selector, queue) nor run the stand-in's forward, i.e. the stack's own work.",
            "",
            "| all samples | share | working samples | share |",
            "| --- | --: | --- | --: |",
        ]
        rows = zip(prof["self"][:10], prof.get("working_self", [])[:10], strict=False)
        lines += [f"| `{a}` | {x:.1%} | `{b}` | {y:.1%} |" for (a, x), (b, y) in rows]
    return "\n".join(lines) + "\n"
