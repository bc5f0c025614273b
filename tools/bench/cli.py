"""`specdec bench`: speculative decoding measured against its anchors, in one run.

Modes (every prompt runs every mode before the next prompt starts, in an order that rotates
from prompt to prompt, so drift of the machine hits all modes alike):

  target      transformers ``generate`` on the target alone: the autoregressive baseline
  k=0         the local stack without speculation (the target through the services)
  k=K         the stack with speculation, for each K of ``--k``
  ssd k=K     the stack with speculative speculative decoding (``--ssd-k``)
  assisted    transformers assisted generation with the same pair, in one process
  draft       the draft alone with ``generate``: not a contender, it measures the cost
              ratio c = draft time per token / target time per token

Greedy decoding throughout, so every mode must reproduce the baseline's tokens; each row
says whether it did. ``--pin`` gives the drafter and the verifier one CPU and one thread
each (separate node pools in miniature); the target alone then runs on the verifier's CPU,
the draft alone on the drafter's, and assisted generation, which needs both models, gets
both CPUs and two threads: the same hardware as the stack.

Output: a markdown table on stdout, and ``results.json``, ``results.md`` and
``speedup.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

QUICK_PROMPTS = 3  # one of each kind
QUICK_TOKENS = 32


@dataclass(frozen=True)
class Prompt:
    kind: str  # code | prose | chat
    text: str | None = None
    messages: list[dict] | None = None


@dataclass(frozen=True)
class Mode:
    name: str
    engine: str  # "hf" | "stack"
    k: int | None = None  # stack: draft length
    ssd: bool = False
    contender: bool = True  # False: measured for the cost ratio only


@dataclass
class Sample:
    tokens: list[int]
    seconds: float
    ttft_ms: float
    stats: dict | None = None  # stack modes: the response's speculation stats


@dataclass
class ModeRun:
    mode: Mode
    samples: list[Sample] = field(default_factory=list)


def load_prompts(path: str | None) -> list[Prompt]:
    if path:
        text = Path(path).read_text()
    else:
        text = resources.files("specdec.tools.benchdata").joinpath("prompts.jsonl").read_text()
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if ("prompt" in row) == ("messages" in row):
            raise ValueError(f"{path or 'prompts.jsonl'}:{n}: give one of prompt or messages")
        prompts.append(Prompt(row.get("kind", "other"), row.get("prompt"), row.get("messages")))
    return prompts


def pick_quick(prompts: list[Prompt]) -> list[Prompt]:
    """The first prompt of each kind."""
    seen: dict[str, Prompt] = {}
    for p in prompts:
        seen.setdefault(p.kind, p)
    return list(seen.values())[:QUICK_PROMPTS]


def build_modes(ks: list[int], ssd_ks: list[int]) -> list[Mode]:
    modes = [Mode("target", "hf"), Mode("k=0", "stack", k=0)]
    modes += [Mode(f"k={k}", "stack", k=k) for k in ks if k > 0]
    modes += [Mode(f"ssd k={k}", "stack", k=k, ssd=True) for k in ssd_ks]
    modes += [Mode("assisted", "hf"), Mode("draft", "hf", contender=False)]
    return modes


def pin_process(cpus: set[int] | None) -> None:
    """Move every thread of this process (torch's pool included) onto `cpus`."""
    if cpus is None:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(tid), cpus)


class HFRunner:
    """The target (and the draft) loaded in this process with transformers."""

    def __init__(self, target: str, draft: str, dtype: str, pinned: tuple[int, int] | None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        dt_ = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        self.target = AutoModelForCausalLM.from_pretrained(target, dtype=dt_[dtype]).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(draft, dtype=dt_[dtype]).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        self.pinned = pinned  # (drafter cpu, verifier cpu)
        self.default_threads = torch.get_num_threads()
        eos = self.target.generation_config.eos_token_id
        self.eos = eos if eos is not None else self.tokenizer.eos_token_id

    def encode(self, prompt: Prompt) -> list[int]:
        if prompt.messages is not None:
            text = self.tokenizer.apply_chat_template(
                prompt.messages, tokenize=False, add_generation_prompt=True
            )
        else:
            text = prompt.text
        return list(self.tokenizer(text).input_ids)

    def _placement(self, mode: Mode) -> tuple[set[int] | None, int]:
        if self.pinned is None:
            return None, self.default_threads
        draft_cpu, target_cpu = self.pinned
        if mode.name == "target":
            return {target_cpu}, 1
        if mode.name == "draft":
            return {draft_cpu}, 1
        return {draft_cpu, target_cpu}, 2

    def run(self, mode: Mode, ids: list[int], n: int) -> Sample:
        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):
            def __init__(self):
                self.puts, self.at = 0, None

            def put(self, value):
                self.puts += 1
                if self.puts == 2:  # the first put is the prompt
                    self.at = time.perf_counter()

            def end(self):
                pass

        torch = self.torch
        cpus, threads = self._placement(mode)
        torch.set_num_threads(threads)
        pin_process(cpus)
        model = self.draft if mode.name == "draft" else self.target
        config = GenerationConfig(
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
        )
        extra = {"assistant_model": self.draft} if mode.name == "assisted" else {}
        streamer = FirstToken()
        input_ids = torch.tensor([ids])
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                streamer=streamer,
                **extra,
            )
        seconds = time.perf_counter() - started
        ttft = ((streamer.at or started + seconds) - started) * 1e3
        return Sample(out[0, len(ids) :].tolist(), seconds, ttft)


# Two bfloat16 computations of the same logits (a one-token decode step and a batched
# verification) differ by a few units in the last place after 28 layers; tokens whose logits
# are this close can come out in either order.
NEAR_TIE_ULPS = 4


def tie_break(hf: HFRunner, ids: list[int], base: list[int], other: list[int]) -> dict:
    """Where `other` first leaves the baseline `base`: how far apart the two tokens' logits
    are there (one forward of the target), in units of the last place of the top logit."""
    torch = hf.torch
    i = _first_difference(other, base)
    if i is None or i >= min(len(base), len(other)):
        return {"position": i, "gap_ulps": None}  # one is a prefix of the other
    with torch.inference_mode():
        logits = hf.target(input_ids=torch.tensor([[*ids, *base[:i]]])).logits[0, -1]
    top = logits.max()
    ulp = float(torch.nextafter(top, top + 1) - top)
    gap = float(abs(logits[base[i]].float() - logits[other[i]].float()))
    return {"position": i, "gap": gap, "ulp": ulp, "gap_ulps": gap / ulp if ulp else None}


def near_ties_only(row: dict) -> bool:
    """Every difference from the baseline starts where the two tokens' logits are within
    NEAR_TIE_ULPS of each other (a numerical near-tie, not a wrong acceptance)."""
    checks = row.get("tie_breaks") or []
    return bool(checks) and all(
        c["gap_ulps"] is not None and c["gap_ulps"] <= NEAR_TIE_ULPS for c in checks
    )


def run_stack_mode(client, mode: Mode, ids: list[int], n: int) -> Sample:
    started = time.perf_counter()
    g = client.generate(token_ids=ids, max_new_tokens=n, k=mode.k, ssd=mode.ssd or None)
    seconds = time.perf_counter() - started
    stats = {
        **dataclasses.asdict(g.stats),
        "accepted_per_position": list(g.stats.accepted_per_position),
    }
    return Sample(list(g.tokens), seconds, g.timings.time_to_first_token_ms, stats)


def summarize(runs: dict[str, ModeRun], cost_ratio: float | None) -> dict[str, dict]:
    """Per mode: throughput, TTFT, acceptance, exactness, speedups, and the bound."""
    base = runs["target"]
    base_tps = _tps(base)
    k0_tps = _tps(runs["k=0"]) if "k=0" in runs else None
    out = {}
    for name, run in runs.items():
        tps = _tps(run)
        row: dict = {
            "engine": run.mode.engine,
            "k": run.mode.k,
            "ssd": run.mode.ssd,
            "contender": run.mode.contender,
            "tokens": sum(len(s.tokens) for s in run.samples),
            "seconds": round(sum(s.seconds for s in run.samples), 3),
            "tokens_per_second": round(tps, 3),
            "ttft_ms": round(sum(s.ttft_ms for s in run.samples) / len(run.samples), 1),
            "speedup_vs_target": round(tps / base_tps, 3),
            "speedup_vs_k0": round(tps / k0_tps, 3) if k0_tps else None,
        }
        row["per_prompt"] = [
            {
                "tokens": len(s.tokens),
                "tokens_per_second": round(len(s.tokens) / s.seconds, 3),
                "ttft_ms": round(s.ttft_ms, 1),
                "first_difference": _first_difference(s.tokens, b.tokens),
                **({"stats": s.stats} if s.stats else {}),
            }
            for s, b in zip(run.samples, base.samples, strict=True)
        ]
        if run.mode.contender:  # the draft alone is not meant to match
            differ = [
                i
                for i, (s, b) in enumerate(zip(run.samples, base.samples, strict=True))
                if s.tokens != b.tokens
            ]
            row |= {"exact": not differ, "mismatched_prompts": differ}
        if run.mode.engine == "stack" and run.mode.k:
            stats = [s.stats for s in run.samples]
            rounds = sum(s["rounds"] for s in stats)
            drafted = sum(s["draft_tokens"] for s in stats)
            accepted = sum(s["accepted_tokens"] for s in stats)
            per_pos = [0] * run.mode.k
            for s in stats:
                for i, a in enumerate(s["accepted_per_position"]):
                    per_pos[i] += a
            mean_len = (accepted + rounds) / rounds if rounds else 0.0
            row |= {
                "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
                "mean_accepted_length": round(mean_len, 3),
                "accepted_per_position": per_pos,
                "rounds": rounds,
                "cache_misses": sum(s["cache_misses"] for s in stats),
            }
            if cost_ratio is not None:
                # Leviathan et al.: speedup <= E / (c k + 1) with E = (1 - a^(k+1)) / (1 - a)
                # the expected tokens per round; E is measured here, so is c.
                row["acceptance_alpha"] = round(_alpha(mean_len, run.mode.k), 4)
                row["bound_speedup"] = round(mean_len / (cost_ratio * run.mode.k + 1), 3)
            # Where a round's time goes, per round (gateway's view).
            row["round_ms"] = round(row["seconds"] * 1e3 / rounds, 1)
            row["drafter_wait_ms_per_round"] = round(_total(stats, "drafter_wait_ms") / rounds, 1)
            if run.mode.ssd:
                hits, misses = _total(stats, "ssd_hits"), _total(stats, "ssd_misses")
                speculated = hits + misses
                row |= {
                    "ssd_hit_rate": round(hits / speculated, 4) if speculated else 0.0,
                    "ssd_branches_per_round": round(_total(stats, "ssd_branches") / rounds, 2),
                    "ssd_hidden_ms_per_round": round(_total(stats, "ssd_hidden_ms") / rounds, 1),
                    "ssd_bytes_per_round": round(_total(stats, "ssd_bytes") / rounds),
                }
        out[name] = row
    return out


def _total(stats: list[dict], key: str) -> float:
    return sum(s[key] for s in stats)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (None if equal)."""
    if a == b:
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _tps(run: ModeRun) -> float:
    return sum(len(s.tokens) for s in run.samples) / sum(s.seconds for s in run.samples)


def _alpha(mean_len: float, k: int) -> float:
    """The i.i.d. acceptance a with (1 - a^(k+1)) / (1 - a) == mean_len (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        e = k + 1 if mid == 1 else (1 - mid ** (k + 1)) / (1 - mid)
        lo, hi = (mid, hi) if e < mean_len else (lo, mid)
    return (lo + hi) / 2


def markdown(rows: dict[str, dict], cost_ratio: float | None) -> str:
    head = (
        "| mode | tok/s | TTFT ms | speedup vs target | vs k=0 | accept | tokens/round "
        "| accepted per position | bound | SSD hits | identical |\n"
        "|---|--:|--:|--:|--:|--:|--:|---|--:|--:|---|\n"
    )
    lines = []
    for name, r in rows.items():
        if not r["contender"]:
            continue

        def f(key, fmt="{:.2f}", row=r):
            v = row.get(key)
            return "" if v is None else fmt.format(v)

        lines.append(
            f"| {name} | {r['tokens_per_second']:.2f} | {r['ttft_ms']:.0f} | "
            f"{r['speedup_vs_target']:.2f}x | {f('speedup_vs_k0', '{:.2f}x')} | "
            f"{f('acceptance_rate', '{:.0%}')} | {f('mean_accepted_length')} | "
            f"{' '.join(map(str, r.get('accepted_per_position', [])))} | "
            f"{f('bound_speedup', '{:.2f}x')} | {f('ssd_hit_rate', '{:.0%}')} | "
            f"{_identical(r)} |"
        )
    tail = ""
    if cost_ratio is not None:
        d = rows["draft"]
        tail = (
            f"\nCost ratio c = {cost_ratio:.3f} (draft alone {d['tokens_per_second']:.2f} tok/s "
            f"vs target alone {rows['target']['tokens_per_second']:.2f} tok/s). "
            "bound = tokens per round / (c k + 1).\n"
        )
    return head + "\n".join(lines) + "\n" + tail


def _identical(row: dict) -> str:
    if row["exact"]:
        return "yes"
    if near_ties_only(row):
        return f"near-tie in prompts {row['mismatched_prompts']}"
    return f"NO {row['mismatched_prompts']}"


def chart(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    spec = sorted((r["k"], r) for r in rows.values() if r["engine"] == "stack" and not r["ssd"])
    ks = [k for k, _ in spec]
    ax.plot(ks, [r["speedup_vs_target"] for _, r in spec], "o-", label="speculative (stack)")
    bound = [(k, r["bound_speedup"]) for k, r in spec if "bound_speedup" in r]
    if bound:
        ax.plot(*zip(*bound, strict=True), "x--", color="gray", label="bound E/(ck+1)")
    ssd = sorted((r["k"], r["speedup_vs_target"]) for r in rows.values() if r["ssd"])
    if ssd:
        ax.plot(*zip(*ssd, strict=True), "s", color="C3", label="SSD (stack)")
    ax.axhline(1.0, color="black", lw=0.8, label="target alone")
    ax.axhline(rows["assisted"]["speedup_vs_target"], color="C2", ls=":", label="HF assisted")
    ax.set_xticks(ks)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over target alone (tokens/s)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cpus": len(os.sched_getaffinity(0)), "platform": platform.platform()}


def add_bench_parser(commands) -> argparse.ArgumentParser:
    from specdec.tools.stack import add_stack_arguments

    p = commands.add_parser(
        "bench", help="benchmark speculation against the target alone and HF assisted generation"
    )
    p.add_argument("--draft-model", help="draft model directory (default: installed pair)")
    p.add_argument("--target-model", help="target model directory (default: installed pair)")
    p.add_argument("--tiny", metavar="DIR", help="tiny random models in DIR (tests the bench)")
    p.add_argument("--prompts", help="JSONL prompt file (default: the shipped set of 12)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, help="use the first N prompts")
    p.add_argument("--k", default="2,3,4", help="draft lengths of the speculation rows")
    p.add_argument("--ssd-k", default="2,3,4", help="draft lengths of the SSD rows (empty: none)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_PROMPTS} prompts (one per kind), {QUICK_TOKENS} new tokens: a smoke run",
    )
    p.add_argument(
        "--pin",
        action="store_true",
        help="drafter on CPU 0, verifier on CPU 1, one thread each (needs 2 CPUs)",
    )
    p.add_argument("--out", default="bench-results", help="folder for JSON, markdown and PNG")
    p.add_argument(
        "--report",
        metavar="DIR",
        help="only re-render DIR/results.md and speedup.png from DIR/results.json",
    )
    add_stack_arguments(p, port_default=0)
    # bfloat16: on CPU a 3-5 token float32 forward costs about 3x a one-token one, which
    # would misstate what verification costs. bfloat16 logits can tie exactly, so where a
    # mode differs from the baseline the bench checks whether it was such a tie-break.
    p.set_defaults(func=run_bench, dtype="bfloat16")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_bench(args: argparse.Namespace) -> int:
    if args.report:
        return report(Path(args.report))
    from specdec.sdk import Client
    from specdec.tools.demo import resolve_models
    from specdec.tools.launcher import ServiceFailed
    from specdec.tools.stack import LocalStack, pin_roles

    problem = resolve_models(args, "bench")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    host = machine()  # before this process pins itself to one CPU
    pinned = None
    if args.pin:
        pinned = pin_roles(args)
        if pinned is None:
            print("specdec bench: --pin needs at least 2 CPUs", file=sys.stderr)
            return 2
    prompts = load_prompts(args.prompts)
    n = args.max_new_tokens
    if args.quick:
        prompts, n = pick_quick(prompts), min(n, QUICK_TOKENS)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    modes = build_modes(_ints(args.k), _ints(args.ssd_k))
    max_k = max((m.k or 0 for m in modes), default=0)
    args.default_k = max(args.default_k, max_k)

    print(f"loading {args.target_model} and {args.draft_model} ({args.dtype}) ...", flush=True)
    hf = HFRunner(args.target_model, args.draft_model, args.dtype, pinned)
    encoded = [hf.encode(p) for p in prompts]
    runs = {m.name: ModeRun(m) for m in modes}
    try:
        with LocalStack(args, announce=print) as stack, Client(stack.gateway.address) as client:
            print("warming up every mode ...", flush=True)
            for m in modes:
                _sample(hf, client, m, encoded[0], 4)
            for i, ids in enumerate(encoded):
                order = modes[i % len(modes) :] + modes[: i % len(modes)]
                for m in order:
                    sample = _sample(hf, client, m, ids, n)
                    runs[m.name].samples.append(sample)
                    print(
                        f"prompt {i + 1}/{len(encoded)} ({prompts[i].kind:<5}) {m.name:<9} "
                        f"{len(sample.tokens) / sample.seconds:6.2f} tok/s",
                        flush=True,
                    )
    except ServiceFailed as e:
        print(f"specdec bench: {e}", file=sys.stderr)
        return 1

    d, t = runs["draft"], runs["target"]
    cost_ratio = _tps(t) / _tps(d)
    rows = summarize(runs, cost_ratio)
    for name, row in rows.items():
        if row.get("exact") is False:
            row["tie_breaks"] = [
                tie_break(hf, encoded[i], t.samples[i].tokens, runs[name].samples[i].tokens)
                for i in row["mismatched_prompts"]
            ]
    import torch
    import transformers

    result = {
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "specdec " + shlex.join(sys.argv[1:]),
            "machine": host,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "target_model": args.target_model,
            "draft_model": args.draft_model,
            "dtype": args.dtype,
            "pin": args.pin,
            "prompts": len(prompts),
            "prompt_kinds": [p.kind for p in prompts],
            "max_new_tokens": n,
            "cost_ratio": round(cost_ratio, 4),
        },
        "modes": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return report(out)


def report(out: Path) -> int:
    """Render results.md and speedup.png from out/results.json and print the table;
    exit status 1 if a mode differs from the baseline other than at near-ties."""
    result = json.loads((out / "results.json").read_text())
    rows, meta = result["modes"], result["meta"]
    table = markdown(rows, meta["cost_ratio"])
    (out / "results.md").write_text(table)
    chart(rows, out / "speedup.png")
    print("\n" + table)
    print(f"wrote {out}/results.md and speedup.png from results.json")
    differ = [n for n, r in rows.items() if r["contender"] and not r["exact"]]
    ties = [n for n in differ if near_ties_only(rows[n])]
    if ties:
        print(
            f"{', '.join(ties)}: differ from the target alone only where the two tokens' "
            f"logits are within {NEAR_TIE_ULPS} units in the last place of {meta['dtype']} "
            "(see tie_breaks in results.json)"
        )
    wrong = [n for n in differ if n not in ties]
    if wrong:
        print(f"NOT IDENTICAL to the target alone: {', '.join(wrong)} (see mismatched_prompts)")
        return 1
    return 0


def _sample(hf: HFRunner, client, mode: Mode, ids: list[int], n: int) -> Sample:
    if mode.engine == "hf":
        return hf.run(mode, ids, n)
    return run_stack_mode(client, mode, ids, n)
