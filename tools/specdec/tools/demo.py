"""`specdec demo`: start the local stack, stream a few prompts, compare with k = 0.

For every prompt it generates once without speculation (k = 0, the target alone through the
same services), once with speculation (streamed to the terminal) and once with speculative
speculative decoding (SSD), then prints tokens/s, the acceptance rate, the SSD hit rate,
the speedups measured in this run, and whether the outputs are identical (they must be:
greedy decoding is exact). It also prints the machine (the CPU and its flags that decide
what bf16 costs, the CUDA device), each replica's dtype and measured forward cost curve
(specdec.common.cost), what the adaptive policy chose per prompt, and, where speculation
did not pay, why.

Every run starts from the state a fresh request would see: the gateway keeps its cache of
recent outputs (suffix drafts) per tenant and each request has a tenant of its own, so the
speculative run of a prompt cannot replay the output of its k = 0 run (that once showed
7.2x where a fresh request got 1.3x). The demo prints the cache state it measured, read
back from the gateway.

Models: the installed default pair (`specdec models install`), --draft-model and
--target-model, or --tiny DIR (random models: shows the mechanics, not speed).

On the CPU the drafter runs the configuration `specdec bench` measured fastest on one
machine (BEST_DRAFTER: int8 weights, a draft 2.7x cheaper at about the same acceptance, on
an Intel Xeon with AMX, 2026-11-22); int8 is CPU-only, so on another --device it runs the
draft model as loaded. --drafter picks any variant of `specdec bench --drafters`. The demo
prints which, and where the choice came from. The draft length is the adaptive policy's,
per round: --k bounds it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from specdec.sdk import Client
from specdec.sdk.types import Generation
from specdec.tools.bench.modes import DRAFTERS
from specdec.tools.costreport import machine_line, policy_line, replica_costs, verdict
from specdec.tools.launcher import ServiceFailed, stopping_children
from specdec.tools.models import resolve_models
from specdec.tools.stack import LocalStack, add_stack_arguments, pin_roles

# The drafter variant of `specdec bench --drafters` that made speculation fastest on the
# pretrained pair on the CPU, in `make bench` (docs/benchmarks/2026-11-22-drafters.md): int8 weights cut the
# draft's cost ratio c from 0.337 to 0.123 of a target step at about the same acceptance
# (78% against 79% at k = 2); SSD k = 2 went from 0.74x to 1.52x of the target alone.
BEST_DRAFTER = "int8"
BEST_DRAFTER_FROM = "`specdec bench` on an Intel Xeon with AMX, 2026-11-22"

# (kind, a prompt's text or a chat's messages)
PROMPTS: list[tuple[str, str | list[dict[str, str]]]] = [
    ("code", "def quicksort(items):\n    "),
    ("prose", "The history of the printing press begins"),
    ("chat", [{"role": "user", "content": "Write a haiku about a lighthouse."}]),
]


def add_demo_parser(commands) -> argparse.ArgumentParser:
    p = commands.add_parser("demo", help="run the local stack and compare speculation with k=0")
    p.add_argument("--draft-model", help="draft model directory (default: the installed pair)")
    p.add_argument("--target-model", help="target model directory (default: the installed pair)")
    p.add_argument(
        "--tiny",
        metavar="DIR",
        help="build tiny random models in DIR and use them (shows the mechanics, not speed)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--k",
        type=int,
        default=4,
        help="most tokens a round may draft: the adaptive policy picks each round's length "
        "(0 included) from the replicas' measured cost and the drafts' measured acceptance",
    )
    p.add_argument(
        "--drafter",
        choices=sorted(DRAFTERS),
        help=f"drafter variant, as in `specdec bench --drafters` (default: {BEST_DRAFTER} "
        "on the CPU, the fastest measured; bf16, the draft model as loaded, elsewhere)",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give the drafter and the verifier one CPU and one thread each (--no-pin: "
        "they share the CPUs)",
    )
    add_stack_arguments(p, port_default=0)
    p.set_defaults(func=run_demo, dtype="fastest")  # each replica measures its own, cached
    return p


# The gateway's cache of recent outputs (suffix drafts) would hold each row's k = 0 output
# when its speculative run starts, and the speculative run would replay it (the code prompt
# once showed 49 of 49 suffix drafts accepted and 7.2x). So the demo runs the gateway's cache
# per tenant and gives every request a tenant of its own: each starts with nothing cached,
# as a fresh request does, and drafts only from its own text and the draft model.
FRESH_CACHE_FLAGS = ("--suffix-cache-scope", "tenant")


@dataclass(frozen=True)
class Row:
    """One prompt's three runs, each from a fresh cache state (FRESH_CACHE_FLAGS)."""

    kind: str
    base: Generation  # k = 0: the target alone through the same services
    spec: Generation  # speculation, streamed
    ssd: Generation  # speculation with SSD


def prepare(args: argparse.Namespace) -> str | None:
    """Resolve the models, the CPUs and the drafter variant, and ask the gateway for a
    cache scope per request (printing what was chosen); an error message when it cannot."""
    problem = resolve_models(args, "demo")
    if problem:
        return problem
    if args.pin and not args.tiny and pin_roles(args):
        print("drafter on CPU 0, verifier on CPU 1, one thread each (--no-pin: share them)")
    if args.drafter is None:  # int8 (--quantize) runs on the CPU only
        args.drafter = BEST_DRAFTER if args.device == "cpu" else "bf16"
    args.drafter_flags = list(DRAFTERS[args.drafter])
    args.gateway_flags = [*FRESH_CACHE_FLAGS]  # before --gateway-arg's, which win
    flags = " ".join(args.drafter_flags) or f"the draft model as loaded, --dtype {args.dtype}"
    best = (
        f" (the fastest measured by {BEST_DRAFTER_FROM}; --drafter bf16 for plain)"
        if args.drafter == BEST_DRAFTER
        else ""
    )
    print(f"drafter variant {args.drafter}: {flags}{best}")
    if not args.tiny:
        print(machine_line())
    return None


def cache_state(client: Client) -> str:
    """What the gateway's cache of recent outputs held when each measured request started,
    from the scope the gateway reports (a --gateway-arg may have changed the demo's)."""
    lookup = client.server_info().lookup
    scope = lookup.get("suffix_cache_scope", "")
    if scope == "off" or not lookup.get("suffix_cache_tokens"):
        return "cache of recent outputs: off; each request drafts from its own text only"
    if scope == "tenant":
        return (
            "cache of recent outputs: a scope per request (--suffix-cache-scope tenant, a "
            "tenant each), so every measured run started with nothing cached, as a fresh "
            "request does: no run replays another run's output"
        )
    return (
        f"cache of recent outputs: scope {scope}, shared by every measured run: a speculative "
        "run may replay its k = 0 run's output, so its speedup overstates a fresh request's"
    )


def measure(
    address: str, args: argparse.Namespace, template, show: Callable[[str], None] = print
) -> list[Row]:
    """Every prompt at k = 0, with speculation (streamed to `show`) and with SSD, each
    request (warm-ups included) with a tenant of its own: with FRESH_CACHE_FLAGS the
    gateway's cache then holds nothing of any earlier run when a request starts."""
    n = args.max_new_tokens
    rows = []
    for kind, prompt in PROMPTS:
        shown = prompt
        if not isinstance(prompt, str):
            # The model sees its chat template (system prompt, special tokens);
            # the terminal shows the conversation.
            shown = "".join(f"[{m['role']}] {m['content']}\n" for m in prompt)
            shown += "[assistant] "
            prompt = template.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True
            )

        def fresh(run: str, kind: str = kind) -> Client:
            return Client(address, tenant=f"demo/{kind}/{run}")

        for ssd in (False, True):  # warm up every path
            with fresh(f"warm-up-ssd-{ssd}") as client:
                client.generate(prompt, max_new_tokens=4, k=args.k, ssd=ssd)
        with fresh("k0") as client:
            base = client.generate(prompt, max_new_tokens=n, k=0)
        show(f"\n--- {kind} (k={args.k}) ---\n{shown}")
        spec = None
        with fresh("spec") as client:
            for chunk in client.stream(prompt, max_new_tokens=n, k=args.k, ssd=False):
                show(chunk.text)
                spec = chunk.final or spec
        show("\n")
        assert spec is not None, "a stream ends with its final chunk"
        with fresh("ssd") as client:
            ssd_run = client.generate(prompt, max_new_tokens=n, k=args.k, ssd=True)
        rows.append(Row(kind, base, spec, ssd_run))
    return rows


@stopping_children  # SIGINT or SIGTERM: every process it started stops
def run_demo(args: argparse.Namespace) -> int:
    problem = prepare(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(args.target_model, gguf_file=args.target_gguf_file)
    try:
        with LocalStack(args, announce=print) as stack:
            assert stack.gateway is not None and stack.drafter and stack.verifier
            with Client(stack.gateway.address) as client:
                cache = cache_state(client)
            print(cache)
            rows = measure(
                stack.gateway.address,
                args,
                template,
                show=lambda text: print(text, end="", flush=True),
            )
            costs = {
                c.role: c for c in replica_costs(stack.drafter.address, stack.verifier.address)
            }
    except ServiceFailed as e:
        print(f"specdec demo: {e}", file=sys.stderr)
        return 1
    print(
        f"\n{'prompt':<8}{'k=0 tok/s':>11}{f'k<={args.k} tok/s':>12}{'accept':>8}"
        f"{'tok/round':>10}{'speedup':>9}{'SSD tok/s':>11}{'hits':>6}{'speedup':>9}  identical"
    )
    for r in rows:
        base, spec, ssd = r.base, r.spec, r.ssd
        print(
            f"{r.kind:<8}{base.tokens_per_second:>11.2f}{spec.tokens_per_second:>12.2f}"
            f"{spec.stats.acceptance_rate:>8.0%}{spec.stats.mean_accepted_length:>10.2f}"
            f"{spec.tokens_per_second / base.tokens_per_second:>8.2f}x"
            f"{ssd.tokens_per_second:>11.2f}{ssd.stats.ssd_hit_rate:>6.0%}"
            f"{ssd.tokens_per_second / base.tokens_per_second:>8.2f}x  "
            f"{'yes' if spec.tokens == base.tokens == ssd.tokens else 'NO'}"
        )
    print(
        "accept: draft tokens accepted over drafted (model and lookup drafts); tok/round: "
        "tokens a round appends (the accepted drafts, lookup extensions included, + 1)"
    )
    print(cache)
    report_costs(rows, costs)
    if any(not r.spec.tokens == r.base.tokens == r.ssd.tokens for r in rows):
        dtype = stack.dtypes.get("verifier", ("",))[0] or args.dtype  # fastest: as chosen
        if dtype == "float32":
            return 1  # no rounding excuse: a difference is a defect
        print(
            f"\nOutputs differ. In {dtype}, two logits within a few units in the last "
            "place can round into a different order in a batched verification than in a "
            "one-token step, and greedy then follows the other token; `specdec bench` checks "
            "every difference for such a near-tie, and the exactness tests run in float32."
        )
    return 0


def report_costs(rows: list[Row], costs) -> None:
    """The replicas' measured cost curves, what the policy chose per prompt, and why
    speculation did not pay where it did not."""
    print()
    for role in ("verifier", "drafter"):
        if role in costs:
            print(costs[role].describe())
    verifier = costs["verifier"].line if "verifier" in costs else None
    drafter = costs["drafter"].line if "drafter" in costs else None
    for r in rows:
        for name, result in (("k", r.spec), ("SSD", r.ssd)):
            print(f"policy for {r.kind} ({name}): {policy_line(result.stats)}")
            why = verdict(
                result.tokens_per_second / r.base.tokens_per_second, result.stats, verifier, drafter
            )
            if why:
                print(f"  {why}")
