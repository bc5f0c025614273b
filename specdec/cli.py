"""The `specdec` command line. Torch-free at import: model code loads only when served."""

from __future__ import annotations

import argparse
import sys

from specdec.common.config import ConfigError


def _serve_replica(role: str):
    def run(args: argparse.Namespace) -> None:
        if role == "drafter":
            from specdec.drafter.server import main
        else:
            from specdec.verifier.server import main
        main(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    from specdec.common.config import ReplicaConfig

    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run one service")
    services = serve.add_subparsers(dest="service", required=True)
    for role, port in (("drafter", 50061), ("verifier", 50062)):
        p = services.add_parser(role, help=f"the {role} service")
        ReplicaConfig.add_arguments(p, default_port=port)
        p.set_defaults(func=_serve_replica(role))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except ConfigError as e:
        print(f"specdec: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
