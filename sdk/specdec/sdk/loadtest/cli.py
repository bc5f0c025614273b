"""`specdec loadtest`: load the gateway at several levels and modes, and report.

Examples::

    specdec loadtest --gateway 127.0.0.1:50051 --concurrency 1,2,4,8,16 \\
        --modes k0,k2,ssd2 --num-requests 64 --max-new-tokens 64 --out loadtest-results
    specdec loadtest --rate 0.5,1,2 --duration 60 --prompts my-prompts.jsonl --check-exact
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import shlex
import sys
from pathlib import Path
from typing import Any

from specdec.sdk.progress import add_progress_argument, progress_enabled

DEFAULT_NUM_REQUESTS = 32


def add_loadtest_parser(commands: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = commands.add_parser(
        "loadtest",
        help="load-test a gateway: throughput and latency per concurrency (or rate) and mode",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--gateway", default="127.0.0.1:50051", help="gateway address host:port")
    p.add_argument(
        "--api",
        default="grpc",
        help="API to load: grpc (the gateway's gRPC API) or openai (its OpenAI-compatible "
        "HTTP API: --gateway is then the HTTP HOST:PORT or URL, OPENAI_API_KEY its token)",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", help="concurrent users per level, e.g. 1,2,4,8,16 (default 1)"
    )
    load.add_argument("--rate", help="Poisson arrival rates in requests/s per level, e.g. 0.5,2")
    p.add_argument(
        "--max-concurrency", type=int, help="with --rate: at most this many conversations in flight"
    )
    p.add_argument(
        "--num-requests",
        type=int,
        help=f"requests per level and mode (default {DEFAULT_NUM_REQUESTS} when no --duration)",
    )
    p.add_argument(
        "--duration", type=float, help="seconds per level and mode (with or without --num-requests)"
    )
    p.add_argument(
        "--modes",
        help="modes run at every level, interleaved: kN (draft length N, k0 = none), ssdN (SSD), "
        "adaptiveN (k_policy adaptive with SSD, k at most N; adaptive: N = 4), default (the "
        "gateway's settings), each optionally @METHOD (model, ngram, suffix, hybrid; else "
        "the gateway's --method); e.g. k0,k2,ssd2,adaptive,k3@ngram,ssd2@hybrid",
    )
    p.add_argument("--k", type=int, help="one mode with this draft length (instead of --modes)")
    p.add_argument(
        "--ssd",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --k: speculative speculative decoding",
    )
    p.add_argument(
        "--tree-width",
        type=int,
        default=1,
        help="also run each speculating mode verifying token trees of this width "
        "('k3@ngram tree3'), interleaved with its chain (1: chains only)",
    )
    p.add_argument("--prompts", help="JSONL prompts or conversations (default: the shipped set)")
    p.add_argument("--num-prompts", type=int, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--output-len-range",
        type=float,
        default=0.0,
        help="ask each prompt's turns for max_new_tokens drawn uniformly within this share "
        "of --max-new-tokens either side (e.g. 0.5 with 32: 16 to 48), the same for a prompt "
        "at every level and in every mode: the users of a closed loop then end their requests "
        "apart, as real requests do (0: all the same length, and they stay in step)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="sampling seed of prompt i: SEED + i")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of each request (s)")
    p.add_argument(
        "--slices",
        type=int,
        help="split each level and mode into this many slices: slice 1 of every level and "
        "mode, then slice 2, ..., modes in rotating order (default 2 with several modes, else 1)",
    )
    p.add_argument(
        "--check-exact",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="greedy: compare every response with the same request run alone at k=0",
    )
    p.add_argument("--out", help="write loadtest.json and loadtest.png into DIR")
    add_progress_argument(p)
    p.set_defaults(func=run_loadtest)
    return p


SHARED_OUTPUTS = (
    "specdec loadtest: warning: the gateway shares its recent outputs between requests "
    "(--suffix-cache-scope {scope}) and this test sends a prompt more than once: a repeated "
    "prompt's later requests may draft by copying an earlier one's output (whole, under "
    "greedy decoding), which measures that cache, not speculation on new text, and favours "
    "the modes that run later. To measure speculation on new text, start the gateway with "
    "--suffix-cache-scope off."
)


def repeats_prompts(
    conversations: int, num_requests: int | None, cells: int, duration: float | None
) -> bool:
    """Whether a test sends some conversation more than once: over its cells (levels x
    modes, each starting from the first conversation) or within one."""
    return cells > 1 or duration is not None or (num_requests or 0) > conversations


def _fail(message: str) -> int:
    print(f"specdec loadtest: {message}", file=sys.stderr)
    return 2


def run_loadtest(args: argparse.Namespace) -> int:
    from specdec.sdk.loadtest.runner import BACKENDS
    from specdec.sdk.loadtest.workload import (
        Mode,
        RequestSettings,
        load_conversations,
        parse_levels,
        parse_modes,
        with_trees,
    )

    if args.api not in BACKENDS:
        return _fail(f"--api {args.api!r} is not built (have: {', '.join(sorted(BACKENDS))})")
    try:
        if args.modes and (args.k is not None or args.ssd):
            raise ValueError("give --modes or --k/--ssd, not both")
        if args.modes:
            modes = parse_modes(args.modes)
        elif args.k is not None:
            modes = parse_modes(f"ssd{args.k}" if args.ssd else f"k{args.k}")
        elif args.ssd:
            modes = [Mode("ssd", k=None, ssd=True)]
        else:
            modes = parse_modes("default")
        modes = with_trees(modes, args.tree_width)
        if args.rate is None:
            levels = parse_levels(args.concurrency or "1", None)
        else:
            levels = parse_levels(None, args.rate, args.max_concurrency)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        if args.num_prompts is not None and args.num_prompts < 1:
            raise ValueError("--num-prompts must be at least 1")
        if args.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be at least 1")
        if args.timeout <= 0:
            raise ValueError("--timeout must be > 0 seconds")
        conversations = load_conversations(args.prompts, args.num_prompts)
        settings = RequestSettings(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            timeout=args.timeout,
            output_len_range=args.output_len_range,
        )
        if args.check_exact and not settings.greedy:
            raise ValueError("--check-exact needs greedy decoding (--temperature 0)")
        num_requests = args.num_requests
        if num_requests is None and args.duration is None:
            num_requests = DEFAULT_NUM_REQUESTS
        slices = args.slices or (2 if len(modes) > 1 else 1)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    try:
        document = asyncio.run(
            _run(args, conversations, modes, levels, settings, num_requests, slices)
        )
    except ValueError as e:
        return _fail(str(e))
    except RuntimeError as e:
        return _fail(str(e))
    from specdec.sdk.loadtest.report import NoMatplotlib, tables, write_json, write_png

    print(tables(document["results"]))
    if args.out:
        out = Path(args.out)
        print(f"\nwrote {write_json(out, document)}")
        try:
            print(f"wrote {write_png(out, document['results'], by_rate=args.rate is not None)}")
        except NoMatplotlib as e:
            print(f"specdec loadtest: {e}", file=sys.stderr)
    exact = document["exact"]
    if exact is not None and exact["mismatches"]:
        print(
            f"specdec loadtest: {exact['mismatches']} of {exact['checked']} responses differ "
            "from the same request run alone at k=0",
            file=sys.stderr,
        )
        return 1
    return 0


async def _run(
    args: argparse.Namespace,
    conversations: Any,
    modes: Any,
    levels: Any,
    settings: Any,
    num_requests: int,
    slices: Any,
) -> dict[str, Any]:
    from specdec.sdk.loadtest.runner import BACKENDS, LoadTest, reference_outputs
    from specdec.sdk.loadtest.summary import summarize
    from specdec.sdk.progress import Progress

    backend = BACKENDS[args.api](args.gateway, settings.timeout)
    total = None
    if num_requests is not None and args.duration is None:
        total = num_requests * len(levels) * len(modes)
    # By --duration every level and mode runs that long (with --num-requests, at most).
    deadline = args.duration * len(levels) * len(modes) if args.duration else None
    shown = progress_enabled(args)
    progress = Progress(sys.stderr, total, enabled=shown, deadline_s=deadline)
    try:
        test = LoadTest(
            backend,
            conversations,
            modes,
            levels,
            settings,
            num_requests=num_requests,
            duration=args.duration,
            slices=slices,
            progress=progress,
            seed=args.seed or 0,
        )
        scope = await backend.suffix_cache_scope()
        if scope not in (None, "off") and repeats_prompts(
            len(conversations), num_requests, len(levels) * len(modes), args.duration
        ):
            print(SHARED_OUTPUTS.format(scope=scope), file=sys.stderr)
        references = None
        if args.check_exact:
            if shown:
                print("running every prompt alone at k=0 for --check-exact ...", file=sys.stderr)
            # A cell starts at most num_requests conversations, from the first one on.
            used = conversations if args.duration else conversations[:num_requests]
            references = await reference_outputs(backend, used, settings, test.run_id)
        started = dt.datetime.now(dt.timezone.utc)
        progress.restart()  # the time left is the load's, not the references'
        cells = await test.run()
    finally:
        await backend.close()
    results = [summarize(cell, references) for cell in cells]
    exact = None
    if references is not None:
        exact = {
            "checked": sum(r["exact_checked"] for r in results),
            "mismatches": sum(r["exact_mismatches"] for r in results),
        }
    return {
        "tool": "specdec loadtest",
        "command": (
            "specdec loadtest " + shlex.join(sys.argv[2:]) if sys.argv[1:2] == ["loadtest"] else ""
        ),
        "started": started.isoformat(timespec="seconds"),
        "config": {
            "gateway": args.gateway,
            "api": args.api,
            "modes": [m.to_dict() for m in modes],
            "levels": [lv.to_dict() for lv in levels],
            "num_requests": num_requests,
            "duration": args.duration,
            "slices": test.slices,
            "prompts": args.prompts or "shipped",
            "num_prompts": len(conversations),
            "max_new_tokens": settings.max_new_tokens,
            "output_len_range": settings.output_len_range,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "top_k": settings.top_k,
            "seed": settings.seed,
            "check_exact": bool(args.check_exact),
            "suffix_cache_scope": scope,
        },
        "results": results,
        "exact": exact,
    }
