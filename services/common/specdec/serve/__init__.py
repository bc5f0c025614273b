"""`specdec serve drafter|verifier|gateway`: the services' command, plugged into `specdec`.

The wiring above the services. Each service's distribution (services/<role>/) registers
itself in the "specdec.services" entry point group as a `Service`: its flags and its
`main`. This command lists the services installed beside it, so an image that holds one
service (the gateway's has no torch and no replica) runs that one, and naming another says
which distribution would add it. Torch-free: a service's code is imported only when that
service runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from specdec.common.settings import ConfigError, SettingsParser

GROUP = "specdec.services"
ROLES = ("drafter", "verifier", "gateway")  # the order `specdec serve --help` lists them


@dataclass(frozen=True)
class Service:
    """One service as `specdec serve` runs it: its settings class and its `main`, named
    "module:attribute" and imported only when used (the parser imports the config, the
    run imports the server); `port`, the default gRPC port a replica's settings take
    (None: the config's own)."""

    role: str
    help: str
    config: str
    main: str
    port: int | None = None

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Declare the service's flags on its subcommand's parser."""
        config = _load(self.config)
        if self.port is None:
            config.add_arguments(parser)
        else:
            config.add_arguments(parser, default_port=self.port)

    def run(self, args: argparse.Namespace) -> None:
        """Run the service until SIGTERM."""
        _load(self.main)(args)


def _load(name: str) -> Any:
    module, attribute = name.split(":")
    return getattr(import_module(module), attribute)


def installed() -> dict[str, Service]:
    """The services installed in this environment, by role."""
    found = {}
    for entry in entry_points(group=GROUP):
        service = entry.load()
        if not isinstance(service, Service) or service.role != entry.name:
            raise RuntimeError(f"{GROUP} entry point {entry.value} is not the {entry.name} Service")
        found[entry.name] = service
    return found


def _runner(service: Service) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from specdec.common.serving import StartFailed

        try:
            service.run(args)
        except ConfigError as e:
            print(f"specdec: configuration error: {e}", file=sys.stderr)
            return 2
        except StartFailed as e:
            print(f"specdec: the {service.role} did not start: {e}", file=sys.stderr)
            return 1
        return 0

    return run


def _missing(role: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(
            f"specdec: the {role} is not installed here: its distribution is specdec-{role} "
            f"(services/{role}/ in the repository)",
            file=sys.stderr,
        )
        return 2

    return run


def add_serve_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    serve = commands.add_parser("serve", help="run one service")
    services = serve.add_subparsers(dest="service", required=True, parser_class=SettingsParser)
    present = installed()
    for role in sorted(present, key=lambda r: (ROLES.index(r) if r in ROLES else len(ROLES), r)):
        service = present[role]
        p = services.add_parser(role, help=service.help)
        service.add_arguments(p)
        p.set_defaults(func=_runner(service))
    for role in ROLES:
        if role not in present:
            p = services.add_parser(role, help=f"the {role} (not installed: specdec-{role})")
            p.add_argument("settings", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
            p.set_defaults(func=_missing(role))
    return serve
