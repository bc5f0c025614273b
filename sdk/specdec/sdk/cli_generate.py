"""``specdec generate``: one generation through the gateway, streamed or as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import grpc

from specdec.sdk.client import (
    DEFAULT_TIMEOUT,
    Client,
    build_generate_request,
    read_token,
    tls_credentials,
)
from specdec.sdk.errors import SpecdecError
from specdec.sdk.types import Generation

__all__ = ["DEFAULT_GATEWAY", "add_generate_parser", "run_generate"]

DEFAULT_GATEWAY = "127.0.0.1:50051"


def _token_ids(value: str) -> list[int]:
    try:
        ids = [int(part) for part in value.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ints: {value!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0: {value!r}")
    return number


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to an ``add_subparsers()`` object; returns its parser."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "generate",
        help="generate text through a gateway",
        description=(
            "Generate a completion through the specdec gateway. Streams the text to stdout "
            "and a summary to stderr, or prints one JSON object with --json."
        ),
    )
    p.add_argument(
        "--gateway",
        metavar="ADDR",
        default=None,
        help=f"gateway host:port (default: $SPECDEC_GATEWAY, else {DEFAULT_GATEWAY})",
    )
    p.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="connect with TLS (implied by --tls-ca / --tls-cert)",
    )
    p.add_argument("--tls-ca", metavar="PEM", help="CA to trust (default: the system's roots)")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate, for mTLS")
    p.add_argument("--tls-key", metavar="PEM", help="client private key, for mTLS")
    p.add_argument(
        "--token-file",
        metavar="FILE",
        default=os.environ.get("SPECDEC_TOKEN_FILE"),
        help="file holding a bearer token (default: $SPECDEC_TOKEN_FILE); never a token itself",
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="prompt text ('-': read stdin)")
    source.add_argument(
        "--token-ids", metavar="1,2,3", type=_token_ids, help="already tokenized prompt"
    )
    p.add_argument("--max-new-tokens", metavar="N", type=int, default=128)
    model = "unset: the model's generation_config"
    p.add_argument("--temperature", metavar="T", type=float, help=f"0: greedy ({model})")
    p.add_argument("--top-p", metavar="P", type=float, help=f"in (0, 1] ({model})")
    p.add_argument("--top-k", metavar="K", type=int, help=f"0: no top-k filter ({model})")
    p.add_argument("--seed", metavar="S", type=int, default=None)
    p.add_argument(
        "--stop",
        metavar="STR",
        action="append",
        default=[],
        help="stop before this string (repeatable)",
    )
    p.add_argument(
        "--k",
        metavar="K",
        type=int,
        default=None,
        help="draft tokens per round (default: the server's; 0: no speculation)",
    )
    p.add_argument(
        "--ssd",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="speculative speculative decoding on/off (default: the server's)",
    )
    p.add_argument(
        "--k-policy",
        choices=("fixed", "adaptive"),
        default=None,
        help="fixed: every round drafts --k; adaptive: --k is an upper bound and the gateway "
        "picks each round's k from acceptance and load (default: the server's)",
    )
    p.add_argument(
        "--method",
        choices=("model", "ngram", "suffix", "hybrid"),
        default=None,
        help="where drafts come from: the draft model, prompt lookup (ngram), suffix decoding "
        "over the request and recent outputs, or hybrid (default: the server's)",
    )
    p.add_argument(
        "--prediction-file",
        metavar="PATH",
        default=None,
        help="text the completion is expected to repeat (OpenAI's Predicted Outputs): "
        "drafts from it cost nothing",
    )
    p.add_argument(
        "--tenant",
        metavar="NAME",
        default=None,
        help="tenant of the gateway's suffix cache (metadata specdec-tenant)",
    )
    p.add_argument("--session", metavar="ID", default=None, help="continue this session")
    p.add_argument(
        "--reset-session",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="forget the session's earlier history",
    )
    p.add_argument(
        "--session-ttl",
        metavar="SECONDS",
        type=int,
        default=0,
        help="idle time after which the session is forgotten (default: the server's)",
    )
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_positive_float,
        default=None,
        help=f"deadline of the call (default: {DEFAULT_TIMEOUT:g})",
    )
    p.add_argument(
        "--json",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="print one JSON object, no streaming",
    )
    p.set_defaults(func=run_generate)
    return p


def _summary(gen: Generation, wall_s: float) -> str:
    tokens_per_s = gen.tokens_per_second
    if tokens_per_s == 0.0 and wall_s > 0:
        tokens_per_s = gen.usage.completion_tokens / wall_s
    parts = [
        f"{gen.usage.completion_tokens} tokens",
        f"finish={gen.finish_reason}",
        f"acceptance={gen.stats.acceptance_rate:.1%}",
        f"{tokens_per_s:.1f} tok/s",
        f"{gen.stats.rounds} rounds",
    ]
    if gen.session_id:
        parts.append(f"session={gen.session_id}")
    if gen.trace_id:
        parts.append(f"trace={gen.trace_id}")
    return "[" + ", ".join(parts) + "]"


def run_generate(args: argparse.Namespace) -> int:
    """Run ``specdec generate``; returns the process exit code."""
    gateway = args.gateway or os.environ.get("SPECDEC_GATEWAY") or DEFAULT_GATEWAY
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    request: dict[str, Any] = {
        "token_ids": args.token_ids,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": tuple(args.stop or ()),
        "session_id": args.session,
        "reset_session": args.reset_session,
        "session_ttl_seconds": args.session_ttl,
        "k": args.k,
        "ssd": args.ssd,
        "k_policy": args.k_policy,
        "method": args.method,
    }
    try:  # reject bad arguments before connecting
        if args.prediction_file:
            with open(args.prediction_file, encoding="utf-8") as f:
                request["prediction"] = f.read()
        build_generate_request(prompt, **request)
    except (ValueError, TypeError, OSError) as e:
        print(f"specdec: invalid arguments: {e}", file=sys.stderr)
        return 2
    timeout = DEFAULT_TIMEOUT if args.timeout is None else args.timeout
    try:
        credentials = None
        if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
            credentials = tls_credentials(args.tls_ca, args.tls_cert, args.tls_key)
        token = read_token(args.token_file) if args.token_file else None
    except (OSError, ValueError) as e:
        print(f"specdec: invalid arguments: {e}", file=sys.stderr)
        return 2
    try:
        with Client(
            gateway, timeout=timeout, credentials=credentials, token=token, tenant=args.tenant
        ) as client:
            if args.json:
                gen = client.generate(prompt, **request)
                print(json.dumps(gen.to_dict(), ensure_ascii=False))
                return 0
            start = time.perf_counter()
            final: Generation | None = None
            for chunk in client.stream(prompt, **request):
                if chunk.text:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                final = chunk.final or final
            if final is not None:
                if sys.stdout.isatty() and not final.text.endswith("\n"):
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                print(_summary(final, time.perf_counter() - start), file=sys.stderr)
            return 0
    except SpecdecError as e:
        print(
            f"specdec: {nothing_listening(gateway, e) or f'{e.code.name}: {e.details}'}",
            file=sys.stderr,
        )
        return 1


# How grpc's UNAVAILABLE begins when no connection could be made (refused, no route, no
# such host): the gateway's own UNAVAILABLE answers never begin so.
_NOT_CONNECTED = ("failed to connect to all addresses", "errors resolving", "DNS resolution failed")


def nothing_listening(gateway: str, error: SpecdecError) -> str | None:
    """The one line that says how to start a stack, when `error` is grpc's failure to
    connect to `gateway` (None for any other error)."""
    if error.code != grpc.StatusCode.UNAVAILABLE or not error.details.startswith(_NOT_CONNECTED):
        return None
    why = error.details.rsplit(": ", 1)[-1].strip("[] ")
    return (
        f"no gateway answers at {gateway} ({why}); start a stack with "
        "`specdec up --draft-model DIR --target-model DIR` (or `specdec demo`), or point "
        "--gateway / SPECDEC_GATEWAY at a running one"
    )
