"""The `specdec` command line. Torch-free at import: model code loads only when served.

This module ships with the SDK (specdec-sdk) and owns `specdec generate` and `specdec
loadtest`. The server distribution (specdec-server) adds `serve`, `up`, `demo`, `models` and `bench` through the
"specdec.commands" entry point group; without it, those commands say what to install.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "specdec.commands"
# Commands that come with specdec-server, named here so their absence gets a clear message.
SERVER_COMMANDS = ("serve", "up", "demo", "models", "bench")


def build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def _build() -> tuple[argparse.ArgumentParser, set[str]]:
    """The parser, and the names of the commands it has."""
    from specdec.sdk.cli_generate import add_generate_parser
    from specdec.sdk.loadtest.cli import add_loadtest_parser

    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(commands)
    add_loadtest_parser(commands)
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        ep.load()(commands)
    return parser, set(commands.choices)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, known = _build()
    if argv and argv[0] in SERVER_COMMANDS and argv[0] not in known:
        print(
            f"specdec: `{argv[0]}` comes with the specdec-server distribution, which is not "
            "installed here (from a checkout: pip install ./sdk '.[replica]', see docs/getting-started/install.md)",
            file=sys.stderr,
        )
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
