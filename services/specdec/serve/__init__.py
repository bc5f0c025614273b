"""`specdec serve drafter|verifier|gateway`: the services' command, plugged into `specdec`.

The wiring above the services: it imports each service's configuration and server, which
import specdec.common, never the other way round. Registered through the
"specdec.commands" entry point of the specdec-server distribution. Torch-free: a service's
code is imported only when that service runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from specdec.common.settings import ConfigError, SettingsParser

PORTS = {"drafter": 50061, "verifier": 50062}


def _runner(service: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        if service == "drafter":
            from specdec.drafter.server import main
        elif service == "verifier":
            from specdec.verifier.server import main
        else:
            from specdec.gateway.server import main
        from specdec.common.serving import StartFailed

        try:
            main(args)
        except ConfigError as e:
            print(f"specdec: configuration error: {e}", file=sys.stderr)
            return 2
        except StartFailed as e:
            print(f"specdec: the {service} did not start: {e}", file=sys.stderr)
            return 1
        return 0

    return run


def add_serve_parser(commands) -> argparse.ArgumentParser:
    from specdec.drafter.config import DrafterConfig
    from specdec.gateway.config import GatewayConfig
    from specdec.verifier.config import VerifierConfig

    serve = commands.add_parser("serve", help="run one service")
    services = serve.add_subparsers(dest="service", required=True, parser_class=SettingsParser)
    for role, config in (("drafter", DrafterConfig), ("verifier", VerifierConfig)):
        p = services.add_parser(role, help=f"the {role} service")
        config.add_arguments(p, default_port=PORTS[role])
        p.set_defaults(func=_runner(role))
    p = services.add_parser("gateway", help="the gateway (public API, speculation loop)")
    GatewayConfig.add_arguments(p)
    p.set_defaults(func=_runner("gateway"))
    return serve
