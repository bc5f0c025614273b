"""The `specdec` command line. Torch-free at import: model code loads only when served.

This module ships with the SDK (specdec-sdk) and owns `specdec generate` and `specdec
loadtest`. The services' shared distribution (specdec-common) adds `serve`, and the tooling
(specdec-tools) `up`, `demo`, `models` and `bench`, through the "specdec.commands" entry
point group; without them, those commands say what to install.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from importlib.metadata import PackageNotFoundError, entry_points, version
from typing import Any

# gRPC's core writes some INFO lines to stderr unless told otherwise (a peer's GOAWAY as
# a replica shuts down, say), between `specdec`'s own one-line errors: only its errors,
# unless GRPC_VERBOSITY is set. Set before gRPC loads; the services that `specdec up`
# starts inherit it.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

ENTRY_POINT_GROUP = "specdec.commands"
# Commands of the other distributions, named here so their absence gets a clear message:
# the command -> (its distribution, how to install it from a checkout).
OTHER_COMMANDS = {
    "serve": ("specdec-common", "pip install ./sdk ./services/common ./services/gateway"),
    **{
        name: ("specdec-tools", "make install")
        for name in ("up", "demo", "models", "bench", "distill")
    },
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """`--help` states every flag's default: argparse's ArgumentDefaultsHelpFormatter,
    less its noise (no default for a flag without one, or for a switch that is off, and
    none added to a help that already states it, as the services' settings do)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        switch = isinstance(action, argparse.BooleanOptionalAction)
        if (
            "default" in text.lower()
            or not action.option_strings
            or (action.nargs == 0 and not switch)
            or default in (None, argparse.SUPPRESS, "", [])
        ):
            return action.help
        if switch:  # --flag / --no-flag: the one in force
            flag = action.option_strings[0]
            return f"{text} (default: {flag if default else '--no-' + flag[2:]})"
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """The `specdec` parser, and every subcommand's parser under it (add_subparsers makes
    them of its class): defaults shown in --help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, set[str]]:
    """The parser, and the names of the commands it has."""
    from specdec.sdk.cli_generate import add_generate_parser
    from specdec.sdk.loadtest.cli import add_loadtest_parser

    parser = Parser(prog="specdec", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version", action="version", version=version_line(), help="print the version and exit"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(commands)
    add_loadtest_parser(commands)
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        ep.load()(commands)
    return parser, set(commands.choices)


def version_line() -> str:
    """`specdec 0.1.0`, plus the version of each other distribution installed beside the SDK
    when it differs (a mixed install is worth seeing)."""
    found = {}
    for dist in (
        "specdec-sdk",
        "specdec-common",
        "specdec-gateway",
        "specdec-replica",
        "specdec-drafter",
        "specdec-verifier",
        "specdec-tools",
    ):
        with contextlib.suppress(PackageNotFoundError):
            found[dist] = version(dist)
    sdk = found.get("specdec-sdk", "unknown")
    others = [f"{d} {v}" for d, v in found.items() if d != "specdec-sdk" and v != sdk]
    return f"specdec {sdk}" + (f" ({', '.join(others)})" if others else "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, known = _build()
    if argv and argv[0] in OTHER_COMMANDS and argv[0] not in known:
        dist, install = OTHER_COMMANDS[argv[0]]
        print(
            f"specdec: `{argv[0]}` comes with the {dist} distribution, which is not "
            f"installed here (from a checkout: {install}, see docs/getting-started/install.md)",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM where a command turns it into one
        return 128 + getattr(e, "signum", signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
