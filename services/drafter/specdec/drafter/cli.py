"""The drafter as `specdec serve drafter` runs it (registered in the "specdec.services"
entry point group by specdec-drafter)."""

from __future__ import annotations

import argparse

from specdec.serve import Service

PORT = 50061  # the drafter's default gRPC port


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.drafter.config import DrafterConfig

    DrafterConfig.add_arguments(parser, default_port=PORT)


def _main(args: argparse.Namespace) -> None:
    from specdec.drafter.server import main

    main(args)


SERVICE = Service("drafter", "the drafter service", _add_arguments, _main)
