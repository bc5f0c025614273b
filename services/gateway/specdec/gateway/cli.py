"""The gateway as `specdec serve gateway` runs it (registered in the "specdec.services"
entry point group by specdec-gateway)."""

from __future__ import annotations

import argparse

from specdec.serve import Service


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.gateway.config import GatewayConfig

    GatewayConfig.add_arguments(parser)


def _main(args: argparse.Namespace) -> None:
    from specdec.gateway.front.server import main

    main(args)


SERVICE = Service("gateway", "the gateway (public API, speculation loop)", _add_arguments, _main)
