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
  draft [D]   the drafter variant D alone through its drafter service (one greedy Draft of
              the whole length): D's cost ratio c, used for the bound of D's rows

``--drafters`` names drafter variants (modes.DRAFTERS: a name and the drafter flags that make
it, e.g. ``int8`` = ``--quantize int8``). They run one after another, each on a stack of its
own (one drafter in memory at a time, on the drafter's CPU), each with its stack modes and
its drafter alone interleaved with the target alone, its baseline (``target [D]`` after the
first). The first variant's run also measures k=0, assisted and the draft in-process. Rows of
a variant other than the default (bf16) are named ``k=2 [D]``.

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
import datetime as dt
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.sdk.progress import Progress, add_progress_argument, progress_enabled
from specdec.tools.bench import memory
from specdec.tools.bench.hf import HFRunner, tie_break
from specdec.tools.bench.modes import (
    ALL_PROMPT_SETS,
    DEFAULT_DRAFTER,
    DRAFTERS,
    LOOKUP_METHODS,
    PROMPT_SETS,
    QUICK_PROMPTS,
    QUICK_TOKENS,
    Mode,
    ModeRun,
    Prompt,
    Sample,
    build_modes,
    head_flags,
    load_prompts,
    parse_drafters,
    pick_quick,
    run_drafter_alone,
    run_stack_mode,
    step_target_name,
    untraced_name,
)
from specdec.tools.bench.report import report
from specdec.tools.bench.shapes import add_shape_arguments
from specdec.tools.bench.stats import cost_ratios, mode_tps, summarize
from specdec.tools.launcher import stopping_children

if TYPE_CHECKING:
    from specdec.tools.otlpsink import OtlpReceiver


def add_bench_parser(commands) -> argparse.ArgumentParser:
    from specdec.tools.stack import add_stack_arguments

    p = commands.add_parser(
        "bench", help="benchmark speculation against the target alone and HF assisted generation"
    )
    p.add_argument("--draft-model", help="draft model directory (default: installed pair)")
    p.add_argument("--target-model", help="target model directory (default: installed pair)")
    p.add_argument("--tiny", metavar="DIR", help="tiny random models in DIR (tests the bench)")
    p.add_argument("--prompts", help="JSONL prompt file (default: the shipped set of 12)")
    p.add_argument(
        "--prompt-set",
        choices=(*PROMPT_SETS, ALL_PROMPT_SETS),
        default="default",
        help="shipped prompt set when --prompts is not given: default (code, prose, chat), "
        "grounded (edits, refactors, extraction, a chat quoting itself) or all (both)",
    )
    p.add_argument(
        "--methods",
        default="",
        help="lookup methods to add rows for, comma-separated (ngram,suffix,hybrid): "
        "'<method> k=K' at the largest --k and 'ssd <method> k=K' at the largest --ssd-k, "
        "plus transformers' prompt lookup; the gateway's cache of outputs is off (every "
        "mode repeats the same prompts)",
    )
    p.add_argument(
        "--tree-width",
        type=int,
        default=1,
        help="also rows verifying token trees of this width beside their chains: the draft "
        "model's dynamic trees ('treeW k=K') and each --methods method's ('<method> treeW "
        "k=K'), adaptive and SSD too (1: none)",
    )
    p.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also the default settings' rows: the adaptive policy with the largest --k (and "
        "--ssd-k) as its bound, plain, with SSD, and per --methods method; the k=K rows draft "
        "k every round (k_policy fixed)",
    )
    p.add_argument(
        "--peers",
        default="",
        help="peer engines to add rows for, comma-separated (vllm: vLLM's CPU build, its "
        "target alone, n-gram and draft-model speculation at the largest --k; llamacpp: "
        "llama.cpp on the pair's GGUF files, the same modes), each from its own virtualenv "
        "(`make peer-bench-install`), after the stack's modes, on the stack's CPUs; a peer "
        "that is not installed or fails is skipped with its reason",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, help="use the first N prompts")
    p.add_argument(
        "--k", help="draft lengths of the speculation rows (default 2,3,4; --overhead: 0,1,4)"
    )
    p.add_argument(
        "--ssd-k",
        help="draft lengths of the SSD rows, empty for none (default 2,3,4; --overhead: 1,4)",
    )
    p.add_argument(
        "--drafters",
        default=DEFAULT_DRAFTER,
        help="drafter variants, comma-separated, each run on its own stack one after another "
        f"with its rows named 'k=2 [name]' (known: {', '.join(DRAFTERS)}; NAME=DIR serves "
        "the drafter in DIR, or the head in DIR over the target when DIR is a head folder "
        "(specdec distill --head), NAME=DIR:VARIANT with a known variant's flags)",
    )
    p.add_argument(
        "--quick",
        action=argparse.BooleanOptionalAction,
        default=False,
        help=f"{QUICK_PROMPTS} prompts (one per kind), {QUICK_TOKENS} new tokens: a smoke run",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="drafter on CPU 0, verifier on CPU 1, one thread each (needs 2 CPUs)",
    )
    p.add_argument(
        "--tracing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run every stack mode traced: the stack exports sampled spans (OTLP/gRPC "
        "to a receiver in this process) and each request's traceparent is sampled for the "
        "'<mode> traced' rows and not for their twins, interleaved on the same processes: "
        "the tracing overhead",
    )
    p.add_argument(
        "--in-process-rows",
        choices=("auto", "interleaved", "after"),
        default="auto",
        help="the in-process rows (target alone, assisted, draft alone) interleaved with the "
        "stack's, prompt by prompt, or after the stack has stopped (their models and the "
        "stack's are then never in memory together); auto: interleaved where both fit in "
        "the memory available",
    )
    o = p.add_argument_group(
        "--overhead",
        "the stack's own cost per round, on stand-in models (tools/specdec/tools/bench/overhead.py)",
    )
    o.add_argument(
        "--overhead",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="measure the stack's cost per round on stand-in models of a fixed forward time "
        "against the same rounds in-process (no real model is loaded)",
    )
    o.add_argument("--target-ms", type=float, default=2.0, help="stand-in target forward (ms)")
    o.add_argument("--draft-ms", type=float, default=0.5, help="stand-in drafter forward (ms)")
    o.add_argument(
        "--acceptance", type=float, default=0.75, help="share of positions the drafter gets right"
    )
    o.add_argument(
        "--target-per-token-ms",
        type=float,
        default=0.0,
        help="plus this per row and token in each target forward (ms): a compute-bound device",
    )
    o.add_argument(
        "--draft-per-token-ms",
        type=float,
        default=0.0,
        help="plus this per row and token in each drafter forward (ms)",
    )
    o.add_argument(
        "--standin-period",
        type=int,
        default=0,
        help="the target's output cycles through this many tokens (0: off), so that lookup "
        "drafts (n-gram) copy it exactly but at --standin-noise",
    )
    o.add_argument(
        "--standin-noise",
        type=float,
        default=0.0,
        help="share of positions where the output leaves the cycle (with --standin-period): "
        "lookup drafts' rejections; the drafter's stay --acceptance",
    )
    o.add_argument("--concurrency", default="1,8", help="sessions at once, comma-separated")
    o.add_argument("--requests", type=int, default=4, help="requests per session and mode")
    o.add_argument(
        "--in-process-prompts", type=int, default=8, help="prompts of the in-process reference"
    )
    o.add_argument(
        "--project", default="7,25", help="GPU step times (ms) to project the speedups at"
    )
    o.add_argument("--profile", metavar="DIR", help="also sample every service with py-spy")
    o.add_argument("--profile-seconds", type=float, default=10.0, help="py-spy per mode")
    # The spelling of an earlier release (now --gateway-arg, as `specdec up`), still read.
    o.add_argument("--gateway-flags", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.add_argument(
        "--structured",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="structured output against free generation (a JSON schema): tokens/s, "
        "acceptance, equality with the target's constrained generate() "
        "(tools/specdec/tools/bench/structured.py); k is the first of --k (default 3)",
    )
    add_shape_arguments(p)
    lk = p.add_argument_group(
        "--lookup-cpu",
        "the gateway's CPU per round for lookup drafts (tools/specdec/tools/bench/lookup_cpu.py)",
    )
    lk.add_argument(
        "--lookup-cpu",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="time the lookup proposers per round (no model, no process)",
    )
    lk.add_argument("--context", type=int, default=4096, help="context tokens of the request")
    lk.add_argument("--rounds", type=int, default=2000, help="rounds to time per method")
    lk.add_argument(
        "--cache-tokens", type=int, default=16384, help="tokens of outputs cached first"
    )
    p.add_argument("--out", default="bench-results", help="folder for JSON, markdown and PNG")
    add_progress_argument(p)
    p.add_argument(
        "--report",
        metavar="DIR",
        help="only re-render DIR/results.md and speedup.png from DIR/results.json",
    )
    add_stack_arguments(p, port_default=0)
    # fastest: the dtype a verifier here measures fastest (specdec.replica.calibrate), for the
    # in-process baselines and both replicas alike. bfloat16 logits can tie exactly, so where
    # a mode differs from the baseline the bench checks whether it was such a tie-break.
    p.set_defaults(func=run_bench, dtype="fastest")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def fastest_step(choice) -> str | None:
    """The weights layout whose one-token forward the calibration measured fastest, when
    it is not the layout the stack runs in (a verifier prices several-token forwards too):
    the target alone is also measured in it, so no speedup is against a slower target."""
    timings = choice.timings_ms
    if not timings:
        return None
    step = min(timings, key=lambda label: timings[label][1])
    return None if step == choice.label else step


def plan_memory(
    args: argparse.Namespace, step: str | None, left_out: dict[str, str], free: int | None = None
) -> tuple[str | None, bool]:
    """Whether the in-process rows run after the stack's (`--in-process-rows`; auto: when
    the in-process models and the stack do not fit in memory together), and the fastest-
    step layout, or None when even its own phase has no room for one more copy of the
    target (the row is then left out, and left_out says why). Sizes from the
    checkpoints' headers (specdec.tools.bench.memory), against `free` bytes (default: what
    this machine has available); where they cannot be read, as asked."""
    stack, in_process, extra = memory.plan(args.target_model, args.draft_model, args.dtype, step)
    free = memory.available() if free is None else free
    after = args.in_process_rows == "after"
    if stack is None or in_process is None or free is None:
        return step, after
    extra = extra or 0
    if args.in_process_rows == "auto" and stack + in_process + extra > free:
        after = True
        print(
            f"bench: the stack ({memory.gib(stack)}) and the in-process models "
            f"({memory.gib(in_process + extra)}) do not fit together in the "
            f"{memory.gib(free)} available: the in-process rows run after the stack's",
            flush=True,
        )
    room = free if after else free - stack
    if step and in_process + extra > room:
        why = (
            f"one more copy of the target ({memory.gib(extra)}) does not fit: "
            f"{memory.gib(room)} available to the in-process rows"
        )
        left_out[step_target_name(step)] = why
        print(f"bench: leaving out the {step_target_name(step)!r} row: {why}", flush=True)
        step = None
    elif not after and stack + in_process > free:
        print(
            f"bench: warning: the run needs about {memory.gib(stack + in_process)} and "
            f"{memory.gib(free)} are available (--in-process-rows {args.in_process_rows})",
            flush=True,
        )
    return step, after


@stopping_children  # SIGINT or SIGTERM: every process it started stops
def run_bench(args: argparse.Namespace) -> int:
    if args.gateway_flags:
        print(
            "specdec bench: --gateway-flags is deprecated and goes in the next release: "
            "write --gateway-arg '" + shlex.join(args.gateway_flags) + "'",
            file=sys.stderr,
        )
        args.gateway_args = [*args.gateway_args, shlex.join(args.gateway_flags)]
        args.gateway_flags = None
    if args.report:
        return report(Path(args.report))
    if args.lookup_cpu:
        from specdec.tools.bench.lookup_cpu import run_lookup_cpu

        return run_lookup_cpu(args)
    if args.overhead:
        from specdec.tools.bench.overhead import run_overhead

        return run_overhead(args)
    if args.structured:
        from specdec.tools.bench.structured import run_structured

        return run_structured(args)
    if args.shapes:
        from specdec.tools.bench.shapes import run_shapes

        return run_shapes(args)
    args.k = "2,3,4" if args.k is None else args.k
    args.ssd_k = "2,3,4" if args.ssd_k is None else args.ssd_k
    from specdec.tools.launcher import ServiceFailed
    from specdec.tools.models import resolve_models
    from specdec.tools.stack import pin_roles, resolve_dtype

    try:
        drafters = args.drafter_variants = parse_drafters(args.drafters)
    except ValueError as e:
        print(f"specdec bench: {e}", file=sys.stderr)
        return 2
    problem = resolve_models(args, "bench")
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from specdec.tools.costreport import machine

    host = machine()  # before this process pins itself to one CPU
    print(host["describe"], flush=True)
    all_cpus = os.sched_getaffinity(0)
    pinned = None
    if args.pin:
        pinned = pin_roles(args)
        if pinned is None:
            print("specdec bench: --pin needs at least 2 CPUs", file=sys.stderr)
            return 2
    methods = tuple(x.strip() for x in args.methods.split(",") if x.strip())
    unknown = [m for m in methods if m not in LOOKUP_METHODS]
    if unknown:
        print(
            f"specdec bench: --methods: unknown {unknown[0]!r}; known: {', '.join(LOOKUP_METHODS)}",
            file=sys.stderr,
        )
        return 2
    prompts = load_prompts(args.prompts, args.prompt_set)
    n = args.max_new_tokens
    if args.quick:
        prompts, n = pick_quick(prompts), min(n, QUICK_TOKENS)
    if args.num_prompts:
        prompts = prompts[: args.num_prompts]
    ks, ssd_ks = _ints(args.k), _ints(args.ssd_k)
    choice = resolve_dtype(args)  # fastest: measured here
    print(f"dtype {choice.summary()}", flush=True)
    step = fastest_step(choice)
    left_out: dict[str, str] = {}  # row -> why it was not measured
    step, args.in_process_after = plan_memory(args, step, left_out)
    phases = [
        (
            d,
            build_modes(
                ks,
                ssd_ks,
                args.tracing and i == 0,
                d,
                i == 0,
                methods,
                args.adaptive,
                step_layout=step,
                tree_width=args.tree_width,
            ),
        )
        for i, d in enumerate(drafters)
    ]
    max_k = max((m.k or 0 for _, modes in phases for m in modes), default=0)
    args.default_k = max(4, max_k)  # the gateway's, for the adaptive rows' bound

    print(f"loading {args.target_model} and {args.draft_model} ({choice.label}) ...", flush=True)
    hf = HFRunner(args.target_model, args.draft_model, args.dtype, pinned, step)
    encoded = [hf.encode(p) for p in prompts]
    runs = {m.name: ModeRun(m) for _, modes in phases for m in modes}
    receiver = None
    parents: dict[str, list[str]] = {}  # --tracing: mode -> the trace ids it sent
    curves: dict[str, dict] = {}  # drafter variant -> each replica's fitted forward cost
    # One step per measured sample (warm-ups and stack starts are not counted, their time is).
    steps = sum(len(modes) * len(encoded) for _, modes in phases)
    progress = Progress(sys.stderr, steps, enabled=progress_enabled(args))
    try:
        for i, (drafter, modes) in enumerate(phases):
            receiver = (
                _run_variant(
                    args,
                    hf,
                    prompts,
                    encoded,
                    n,
                    drafter,
                    modes,
                    runs,
                    i == 0,
                    parents,
                    curves,
                    progress,
                )
                or receiver
            )
    except ServiceFailed as e:
        print(f"specdec bench: {e}", file=sys.stderr)
        return 1
    finally:
        progress.close()

    peers = None
    if args.peers.strip():
        os.sched_setaffinity(0, all_cpus)  # the peers get the stack's CPUs
        peers = run_peers(args, hf, prompts, n, max(ks, default=3))
    c_hf = mode_tps(runs["target"]) / mode_tps(runs["draft"])
    ratios = cost_ratios(runs)
    rows = summarize(runs, ratios)
    tracing_meta = None
    if args.tracing:
        assert receiver is not None  # the first variant's run had traced modes
        tracing_meta = check_traced(runs, parents, receiver)
        for name, row in rows.items():
            if row["traced"]:
                twin = rows[untraced_name(name)]
                row["untraced_seconds"] = twin["seconds"]
                row["tracing_slowdown"] = round(
                    twin["tokens_per_second"] / row["tokens_per_second"] - 1, 4
                )
    for name, row in rows.items():
        if row.get("exact") is False:
            base = runs[row["baseline"]]
            row["tie_breaks"] = [
                tie_break(hf, encoded[i], base.samples[i].tokens, runs[name].samples[i].tokens)
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
            "prompt_set": args.prompts or args.prompt_set,
            "methods": list(methods),
            "prompt_kinds": [p.kind for p in prompts],
            "max_new_tokens": n,
            # The draft alone in-process (`generate`) against the target alone: c as the
            # bench has always measured it, for the default model in --dtype.
            "cost_ratio": round(c_hf, 4),
            # Per drafter variant, through its drafter service: the c of its rows' bound.
            "drafters": {
                d: {
                    "flags": list(drafters[d]),
                    "cost_ratio": round(ratios[d], 4),
                    "draft_tokens_per_second": rows[f"draft [{d}]"]["tokens_per_second"],
                    "baseline": rows[f"draft [{d}]"]["baseline"],
                    "target_tokens_per_second": rows[rows[f"draft [{d}]"]["baseline"]][
                        "tokens_per_second"
                    ],
                }
                for d in drafters
            },
            "tracing": tracing_meta,
            # Per drafter variant: each replica's dtype and t(n) = base + per_token n (ms),
            # fitted on the replica over the run (specdec.common.cost).
            "cost_curves": curves,
            # Rows the run left out, and why (plan_memory), and whether the in-process
            # rows ran after the stack's rather than interleaved with them.
            "left_out": left_out,
            "in_process_rows": "after" if args.in_process_after else "interleaved",
        },
        "modes": rows,
        "peers": peers,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    return report(out)


VLLM_CPU_ENGINE = {"engine_args": {"enforce_eager": True, "kv_cache_memory_bytes": 2 << 30}}


def run_peers(
    args: argparse.Namespace, hf: HFRunner, prompts: list[Prompt], n: int, k: int
) -> dict:
    """The --peers rows (specdec.tools.bench.peers): each peer's target alone, n-gram and
    draft-model speculation at k, over the same prompts as the model reads them."""
    from specdec.tools.bench import peers as peer_engines
    from specdec.tools.bench.modes import prompt_text
    from specdec.tools.models import DEFAULT_DRAFT, DEFAULT_TARGET

    texts = [prompt_text(hf.tokenizer, p) for p in prompts]
    threads = len(os.sched_getaffinity(0))
    out: dict = {"threads": threads, "by_peer": {}}
    for name in (x.strip() for x in args.peers.split(",") if x.strip()):
        reason = peer_engines.peer_available(name)
        if reason is None and (args.tiny or args.draft_model is None):
            reason = "runs on the installed pretrained pair only"
        if reason is not None:
            print(f"peer {name}: skipped: {reason}", flush=True)
            out["by_peer"][name] = {"skipped": reason}
            continue
        try:
            target_gguf, target_dir = peer_engines.model_files(DEFAULT_TARGET)
            draft_gguf, draft_dir = peer_engines.model_files(DEFAULT_DRAFT)
        except peer_engines.PeerError as e:
            out["by_peer"][name] = {"skipped": str(e)}
            continue
        modes = ["target", f"ngram k={k}", f"draft k={k}"]
        print(f"peer {name}: {', '.join(modes)} ...", flush=True)
        rows = peer_engines.run_peer(
            name,
            target_gguf=target_gguf,
            draft_gguf=draft_gguf,
            target_dir=target_dir,
            draft_dir=draft_dir,
            prompts=texts,
            max_new_tokens=n,
            modes=modes,
            threads=threads,
            dtype=args.dtype,
            keep_going=True,
            # vLLM's compiled mode recompiles for minutes on 2 cores before a token: eager,
            # with a fixed KV cache, is what runs here.
            extra=VLLM_CPU_ENGINE if name == "vllm" else None,
        )
        by_mode: dict[str, dict] = {}
        for mode in modes:
            mine = [r for r in rows if r["mode"] == mode]
            errors = [r["error"] for r in mine if "error" in r]
            if errors:
                by_mode[mode] = {"error": errors[0]}
                continue
            tokens = sum(r["tokens"] for r in mine)
            seconds = sum(r["seconds"] for r in mine)
            accepts = [r["acceptance"] for r in mine if r.get("acceptance") is not None]
            by_mode[mode] = {
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_second": round(tokens / seconds, 3) if seconds else None,
                "acceptance": round(sum(accepts) / len(accepts), 4) if accepts else None,
                "version": next((r["version"] for r in mine if r.get("version")), ""),
                "per_prompt": [
                    {
                        "tokens": r["tokens"],
                        "tokens_per_second": r["tokens_per_second"],
                        "token_ids": r["token_ids"],
                    }
                    for r in mine
                ],
            }
            print(f"peer {name} {mode}: {by_mode[mode]['tokens_per_second']} tok/s", flush=True)
        out["by_peer"][name] = {"modes": by_mode}
    return out


def _run_variant(
    args: argparse.Namespace,
    hf: HFRunner,
    prompts: list[Prompt],
    encoded: list[list[int]],
    n: int,
    drafter: str,
    modes: list[Mode],
    runs: dict[str, ModeRun],
    first: bool,
    parents: dict[str, list[str]],
    curves: dict[str, dict],
    progress: Progress,
) -> OtlpReceiver | None:
    """Every prompt through every mode of one drafter variant, on a stack of its own (its
    drafter flags added, --max-draft-tokens raised for the drafter-alone Draft of n tokens);
    the stack stops before the next variant's starts. Returns the OTLP receiver when this
    run has traced modes: the stack then exports sampled spans, and each request's
    traceparent says whether it is sampled (parents: the trace ids each mode sent), so
    traced and untraced requests run on the same processes and differ only in recording
    and exporting spans."""
    from specdec.sdk import Client
    from specdec.tools.stack import LocalStack

    variant = argparse.Namespace(**vars(args))
    flags = head_flags(args.drafter_variants[drafter], args.target_model)
    variant.drafter_flags = [*flags, "--max-draft-tokens", str(max(16, n))]
    # Every mode runs the same prompts: a cache of earlier modes' outputs would draft the
    # answer itself. Lookups here see the request's own text (and its prediction) only.
    variant.gateway_flags = ["--suffix-cache-scope", "off"]  # before --gateway-arg's
    if args.log_dir and not first:
        variant.log_dir = str(Path(args.log_dir) / drafter)
    receiver = None
    print(f"drafter variant {drafter}: {' '.join(flags) or 'as loaded'}", flush=True)
    with contextlib.ExitStack() as resources:
        if any(m.traced for m in modes):
            from specdec.tools.otlpsink import OtlpReceiver

            receiver = resources.enter_context(OtlpReceiver())
            variant.otlp_endpoint = receiver.endpoint
            variant.otlp_protocol, variant.trace_sample_ratio = "grpc", 1.0
        stack = resources.enter_context(LocalStack(variant, announce=print))
        assert stack.gateway is not None  # started
        client = resources.enter_context(Client(stack.gateway.address))
        after = args.in_process_after
        in_stack = [m for m in modes if not (after and m.engine == "hf")]
        if not after:
            hf.load()  # before any sample: loading is not a mode's time
        _measure(hf, client, stack, prompts, encoded, n, in_stack, runs, parents, progress,
                 drafter, first)  # fmt: skip
        curves[drafter] = _curves(stack)
    if after:  # the stack has stopped: its memory is free for the in-process models
        print("in-process rows, the stack stopped ...", flush=True)
        hf.load()
        in_process = [m for m in modes if m.engine == "hf"]
        _measure(hf, None, None, prompts, encoded, n, in_process, runs, parents, progress,
                 drafter, False)  # fmt: skip
        hf.unload()  # the next variant's stack needs the room
    return receiver


def _measure(
    hf, client, stack, prompts, encoded, n, modes, runs, parents, progress, drafter, first
) -> None:
    """Every prompt through every mode of `modes`, after one warm-up of each; the order of
    the modes rotates from prompt to prompt, so drift of the machine hits all alike."""
    print("warming up every mode ...", flush=True)
    for m in modes:
        progress.begin(f"{drafter}: warming up {m.name}")
        _sample(hf, client, stack, m, encoded[0], 4, {})
    if first:
        progress.restart()  # the time left from the measured samples' pace
    for i, ids in enumerate(encoded):
        order = modes[i % len(modes) :] + modes[: i % len(modes)]
        for m in order:
            progress.begin(f"prompt {i + 1}/{len(encoded)} {m.name}")
            sample = _sample(hf, client, stack, m, ids, n, parents)
            runs[m.name].samples.append(sample)
            progress.clear()
            print(
                f"prompt {i + 1}/{len(encoded)} ({prompts[i].kind:<5}) {m.name:<14} "
                f"{len(sample.tokens) / sample.seconds:6.2f} tok/s",
                flush=True,
            )
            progress.step()
    progress.clear()


def _curves(stack) -> dict[str, dict]:
    """Each replica's dtype and fitted forward cost (one row), as the run left them."""
    from specdec.tools.costreport import replica_costs

    out = {}
    for c in replica_costs(stack.drafter.address, stack.verifier.address):
        print(c.describe(), flush=True)
        line = c.line
        out[c.role] = {
            "dtype": c.dtype,
            "base_ms": round(line.base_ms, 3) if line else None,
            "per_token_ms": round(line.per_token_ms, 4) if line else None,
            "step_ms": round(line.step_ms, 3) if line else None,
        }
    return out


def _sample(
    hf: HFRunner,
    client,
    stack,
    mode: Mode,
    ids: list[int],
    n: int,
    parents: dict[str, list[str]],
) -> Sample:
    if mode.engine == "hf":
        return hf.run(mode, ids, n)
    if mode.engine == "drafter":
        return run_drafter_alone(stack.drafter.address, ids, n, "r/bench-draft-alone")
    if not stack.args.otlp_endpoint:
        return run_stack_mode(client, mode, ids, n)
    with _parent(mode, parents):
        return run_stack_mode(client, mode, ids, n)


@contextlib.contextmanager
def _parent(mode: Mode, parents: dict[str, list[str]]):
    """Under --tracing every stack request carries a traceparent (the SDK sends the
    caller's context): sampled for '<mode> traced', not sampled for its twin, so the
    services' parent-based sampler records and exports the one and drops the other."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    ids = RandomIdGenerator()
    context = trace.SpanContext(
        ids.generate_trace_id(),
        ids.generate_span_id(),
        is_remote=False,
        trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED if mode.traced else 0),
    )
    parents.setdefault(mode.name, []).append(trace.format_trace_id(context.trace_id))
    with trace.use_span(trace.NonRecordingSpan(context)):
        yield


def check_traced(
    runs: dict[str, ModeRun],
    parents: dict[str, list[str]],
    receiver: OtlpReceiver,
    wait: float = 30,
) -> dict:
    """Every traced request must have its trace in the receiver (else the overhead figure
    would measure nothing), and no untraced one may have any span there (else the baseline
    would pay for tracing too). Returns what was received."""
    traced = [s for r in runs.values() if r.mode.traced for s in r.samples]
    sent_traced = {t for name, ts in parents.items() if runs[name].mode.traced for t in ts}
    sent_untraced = {t for name, ts in parents.items() if not runs[name].mode.traced for t in ts}
    wanted = {s.trace_id for s in traced}
    if "" in wanted:
        raise RuntimeError("a traced request came back without a trace id")
    if wanted - sent_traced:
        raise RuntimeError("a traced request was answered under a trace it did not send")
    receiver.wait_for(lambda spans: wanted <= {x.trace_id for x in spans}, timeout=wait)
    spans = receiver.spans()
    leaked = sent_untraced & {x.trace_id for x in spans}
    if leaked:
        raise RuntimeError(f"{len(leaked)} untraced requests left spans in the receiver")
    return {
        "traced_requests": len(traced),
        "untraced_requests": len(sent_untraced),
        "spans_received": len(spans),
        "spans_per_request": round(len(spans) / len(wanted), 1),
        "sampler": "parentbased_traceidratio 1.0; each request's traceparent decides",
        "exporter": "otlp grpc, batch span processor, receiver in the bench process",
    }
