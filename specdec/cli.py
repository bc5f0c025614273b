"""The `specdec` command line. Torch-free at import: model code loads only when served."""

from __future__ import annotations

import argparse
import sys

from specdec.common.config import ConfigError


def _serve(service: str):
    def run(args: argparse.Namespace) -> None:
        if service == "drafter":
            from specdec.drafter.server import main
        elif service == "verifier":
            from specdec.verifier.server import main
        else:
            from specdec.gateway.server import main
        main(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    from specdec.bench import add_bench_parser
    from specdec.common.config import ReplicaConfig
    from specdec.demo import add_demo_parser
    from specdec.gateway.config import GatewayConfig
    from specdec.models import add_models_parser
    from specdec.sdk.cli_generate import add_generate_parser
    from specdec.stack import add_up_parser

    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run one service")
    services = serve.add_subparsers(dest="service", required=True)
    for role, port in (("drafter", 50061), ("verifier", 50062)):
        p = services.add_parser(role, help=f"the {role} service")
        ReplicaConfig.add_arguments(p, default_port=port, role=role)
        p.set_defaults(func=_serve(role))
    p = services.add_parser("gateway", help="the gateway (public API, speculation loop)")
    GatewayConfig.add_arguments(p)
    p.set_defaults(func=_serve("gateway"))

    add_generate_parser(commands)
    add_up_parser(commands)
    add_demo_parser(commands)
    add_models_parser(commands)
    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"specdec: configuration error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
