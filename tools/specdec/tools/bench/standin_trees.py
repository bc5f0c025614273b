"""`python -m specdec.tools.bench.standin_trees`: the draft model's token trees against its
chains on stand-in models whose every forward takes a fixed time (a GPU's flat cost curve).

The stand-ins (specdec.tools.bench.standin): a target of ``--target-ms`` per forward and a
drafter of ``--draft-ms``, the drafter right at an ``--acceptance`` share of positions and
the target's token its runner-up where it is not. The stack (Redis, drafter, verifier,
gateway on loopback, as `specdec up`) serves greedy requests of every mode, interleaved:
for each k policy of ``--policies`` a chain (draft length ``--k``) and a tree of width
``--tree-width`` (the drafter's dynamic tree, its best leaves continued as the policy
sizes it, docs/concepts/trees.md), and with ``--ssd`` both again with SSD. Each
repetition sends every mode's requests in turn, the order rotating, so drift of a shared
machine hits the modes alike.

Reported per mode: tokens per round, tokens per second (the client's clock), the steady
round time (the gateway's, after the first round), the trees' rounds and nodes and the
rounds whose path left the draft; per policy the tree's ratios to its chain. Every output
is compared token for token with the target alone (the replicas' own jobs in this process,
k = 0); an output that differs makes the run fail (exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from specdec.tools.bench.overhead import Tally


@dataclass(frozen=True)
class Mode:
    policy: str  # the request's k_policy
    tree_width: int  # 1: a chain
    ssd: bool = False

    @property
    def name(self) -> str:
        tree = f" tree{self.tree_width}" if self.tree_width > 1 else ""
        return f"{'ssd ' if self.ssd else ''}{self.policy}{tree}"


@dataclass
class Row(Tally):
    """A mode's requests (specdec.tools.bench.overhead.Tally) and its trees."""

    tree_rounds: int = 0
    tree_nodes: int = 0
    other_branch_rounds: int = 0

    def add(self, wall: float, result, exact: bool) -> None:
        super().add(wall, result, exact)
        self.tree_rounds += result.stats.tree_rounds
        self.tree_nodes += result.stats.tree_nodes
        self.other_branch_rounds += result.stats.tree_other_branch_rounds

    def summary(self) -> dict:
        return {
            "requests": self.requests, "tokens": self.tokens, "rounds": self.rounds,
            "tree_rounds": self.tree_rounds, "tree_nodes": self.tree_nodes,
            "other_branch_rounds": self.other_branch_rounds, "exact": self.exact,
            "tokens_per_round": round(self.tokens_per_round, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "ms_per_round": round(self.ms_per_round, 3) if self.steady_rounds else None,
        }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specdec.tools.bench.standin_trees")
    p.add_argument("--target-ms", type=float, default=20.0, help="a target forward's time")
    p.add_argument("--draft-ms", type=float, default=2.0, help="a drafter forward's time")
    p.add_argument("--acceptance", type=float, default=0.7, help="the drafter's right share")
    p.add_argument("--k", type=int, default=4, help="draft length (adaptive: its bound)")
    p.add_argument("--tree-width", type=int, default=3)
    p.add_argument("--policies", default="fixed,adaptive", help="k policies, comma-separated")
    p.add_argument("--ssd", action="store_true", help="also every mode with SSD")
    p.add_argument("--prompts", type=int, default=8, help="prompts of the default set")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="passes over every mode")
    p.add_argument("--out", type=Path, help="write result.json and report.md here")
    p.add_argument("--log-dir", help="the services' logs")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    from specdec.tools.bench.standin import build_standins
    from specdec.tools.costreport import machine

    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    modes = [Mode(p, w, ssd) for ssd in (False, True)[: 1 + args.ssd] for p in policies
             for w in (1, args.tree_width)]  # fmt: skip
    n = args.max_new_tokens
    with tempfile.TemporaryDirectory(prefix="specdec-standin-trees-") as workdir:
        models = build_standins(Path(workdir), args.target_ms, args.draft_ms, args.acceptance)
        results = _run_modes(args, models, modes)
    ratios = {}
    for m in modes:
        if m.tree_width > 1:
            tree, chain = results[m.name], results[Mode(m.policy, 1, m.ssd).name]
            ratios[m.name] = {
                "tokens_per_round": round(tree["tokens_per_round"] / chain["tokens_per_round"], 4),
                "tokens_per_second": round(
                    tree["tokens_per_second"] / chain["tokens_per_second"], 4
                ),
            }
    settings = dict(
        target_ms=args.target_ms, draft_ms=args.draft_ms, acceptance=args.acceptance,
        k=args.k, tree_width=args.tree_width, prompts=args.prompts, max_new_tokens=n,
        repeats=args.repeats,
    )  # fmt: skip
    return {
        "machine": machine(),
        "settings": settings,
        "modes": results,
        "tree_vs_chain": ratios,
        "exact": all(r["exact"] for r in results.values()),
    }


def _run_modes(args: argparse.Namespace, models, modes: list[Mode]) -> dict[str, dict]:
    """Every mode's requests through a stack serving the stand-ins, interleaved; each
    mode's summary."""
    from specdec.sdk import Client
    from specdec.tools.bench.modes import load_prompts
    from specdec.tools.bench.overhead import InProcess, standin_stack_args
    from specdec.tools.stack import LocalStack
    from specdec.tools.tinymodels import _build_tokenizer

    n = args.max_new_tokens
    tokenizer = _build_tokenizer()
    prompts = [tokenizer(p.text).input_ids for p in load_prompts(None) if p.text]
    prompts = prompts[: max(1, args.prompts)]
    print(f"stand-ins: target {args.target_ms} ms, drafter {args.draft_ms} ms", flush=True)
    alone = InProcess(models.draft, models.target)
    reference = {tuple(ids): alone.generate(ids, n, 0)[0] for ids in prompts}
    rows = {m: Row() for m in modes}
    stack_args = standin_stack_args(
        models, args.k, args.log_dir, [], [], ["--suffix-cache-scope off"]
    )
    with (
        LocalStack(stack_args, announce=print) as stack,
        Client(stack.gateway.address, timeout=600) as client,
    ):

        def send(m: Mode, ids: list[int], tokens: int):
            return client.generate(
                token_ids=ids, max_new_tokens=tokens, k=args.k, method="model", ssd=m.ssd,
                k_policy=m.policy, tree_width=m.tree_width,
            )  # fmt: skip

        for m in modes:  # warm-up
            send(m, prompts[0], 8)
        for rep in range(max(1, args.repeats)):
            for m in modes[rep % len(modes) :] + modes[: rep % len(modes)]:
                for ids in prompts:
                    started = time.perf_counter()
                    result = send(m, ids, n)
                    wall = time.perf_counter() - started
                    rows[m].add(wall, result, list(result.tokens) == reference[tuple(ids)])
    return {m.name: rows[m].summary() for m in modes}


def render(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# Trees against chains on stand-ins (target {s['target_ms']} ms, drafter "
        f"{s['draft_ms']} ms, acceptance {s['acceptance']}, k {s['k']}, width "
        f"{s['tree_width']}; {s['prompts']} prompts x {s['max_new_tokens']} tokens x "
        f"{s['repeats']})",
        "",
        "| mode | tokens/round | tokens/s | ms/round | tree rounds | nodes/tree round | "
        "left the draft | exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["modes"].items():
        per = r["tree_nodes"] / r["tree_rounds"] if r["tree_rounds"] else 0.0
        lines.append(
            f"| {name} | {r['tokens_per_round']:.3f} | {r['tokens_per_second']:.1f} | "
            f"{r['ms_per_round'] or 0:.2f} | {r['tree_rounds']} | {per:.1f} | "
            f"{r['other_branch_rounds']} | {r['exact']} |"
        )
    lines += ["", "| tree / chain | tokens/round | tokens/s |", "|---|---|---|"]
    for name, r in result["tree_vs_chain"].items():
        lines.append(f"| {name} | {r['tokens_per_round']:.3f} | {r['tokens_per_second']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    report = render(result)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2))
        (args.out / "report.md").write_text(report)
    if not result["exact"]:
        print("an output differs from the target alone's", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
