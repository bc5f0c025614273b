"""The verifier as `specdec serve verifier` runs it (registered in the "specdec.services"
entry point group by specdec-verifier)."""

from __future__ import annotations

import argparse

from specdec.serve import Service

PORT = 50062  # the verifier's default gRPC port


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdec.verifier.config import VerifierConfig

    VerifierConfig.add_arguments(parser, default_port=PORT)


def _main(args: argparse.Namespace) -> None:
    from specdec.verifier.server import main

    main(args)


SERVICE = Service("verifier", "the verifier service", _add_arguments, _main)
