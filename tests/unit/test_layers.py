"""The layers: torch and transformers stay in specdec.replica (the engine the drafter and
the verifier run). Every module of specdec.common, the gateway and the SDK import neither,
and nor do the engine's seam (specdec.replica.engine) and the replica's modules that
`specdec serve` or a replica's servers load before the engine (its config, metrics, data
plane and CPU budget). Each probe runs in a fresh interpreter, so that what this test
process has imported does not count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PACKAGES = ("torch", "transformers")


def modules_in(folder: Path, package: str) -> list[str]:
    """The import names of the modules in a package's folder, subpackages included."""
    names = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join((package, *parts)))
    return names


TORCH_FREE = [
    *modules_in(ROOT / "services" / "common" / "specdec" / "common", "specdec.common"),
    "specdec.gateway.front.server",
    "specdec.gateway.front.turn",
    *modules_in(ROOT / "sdk" / "specdec" / "sdk", "specdec.sdk"),
    "specdec.replica.engine",
    "specdec.replica.config",
    "specdec.replica.metrics",
    "specdec.replica.dataplane",
    "specdec.replica.cpus",
]


def probed(probe: str) -> str:
    """What the code `probe` prints in a fresh interpreter (which must succeed)."""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def engine_packages_after(modules: list[str]) -> set[str]:
    """Which of ENGINE_PACKAGES a fresh interpreter holds after importing `modules`."""
    probe = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(' '.join(p for p in {ENGINE_PACKAGES!r} if p in sys.modules))\n"
    )
    return set(probed(probe).split())


def test_common_gateway_and_sdk_import_neither_torch_nor_transformers():
    assert {"specdec.common", "specdec.common.errors", "specdec.replica.config"} <= set(TORCH_FREE)
    assert {"specdec.sdk", "specdec.sdk.client", "specdec.sdk.loadtest.runner"} <= set(TORCH_FREE)
    assert engine_packages_after(TORCH_FREE) == set()


def test_the_gateway_loads_no_replica_module():
    """The gateway's server and HTTP API load nothing of the replicas (what only they use
    lives in specdec.replica, not in specdec.common)."""
    probe = (
        "import sys\n"
        "import specdec.gateway.front.server, specdec.gateway.front.http.app\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[:2] in "
        "(['specdec', 'replica'], ['specdec', 'drafter'], ['specdec', 'verifier']))))\n"
    )
    assert probed(probe).split() == []


def test_the_probe_sees_the_engine():
    """The probe above can fail: the engine's runtime pulls torch in."""
    assert "torch" in engine_packages_after(["specdec.replica.runtime"])


def test_serving_a_replica_loads_no_gateway_code():
    """`specdec serve drafter|verifier` builds every service's flags (the gateway's too),
    but a replica process must not load the gateway's modules: importing
    specdec.gateway.observe.metrics registers the gateway's metrics, which a replica would then
    export beside its own (test_prometheus caught that once, through the lookup
    settings' defaults)."""
    probe = (
        "import argparse, sys\n"
        "from specdec.serve import add_serve_parser\n"
        "add_serve_parser(argparse.ArgumentParser().add_subparsers())\n"
        "import specdec.drafter.server, specdec.verifier.server\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('specdec.gateway.')"
        " and m != 'specdec.gateway.config' and not m.startswith('specdec.gateway.round.lookup'))))\n"
        "print('specdec.gateway.observe.metrics' in sys.modules)\n"
    )
    out = probed(probe)
    assert out.splitlines()[-1] == "False", out


def _requirements(part: str) -> list[str]:
    """The names of what services/<part>/'s distribution depends on, its own and, for the
    repository's distributions among them, theirs (read from the pyproject files)."""
    import re

    import tomllib

    project = tomllib.loads((ROOT / "services" / part / "pyproject.toml").read_text())["project"]
    names = []
    for requirement in project["dependencies"]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        names.append(name)
        if name.startswith("specdec-") and name != "specdec-sdk":
            names += _requirements(name.removeprefix("specdec-"))
    return names


def test_each_service_is_a_distribution_of_its_own_and_the_gateways_has_no_torch():
    """The design's folders: services/gateway/, drafter/ and verifier/ each hold their
    service's package, its pyproject.toml and its Dockerfile; the gateway's distribution
    needs neither torch nor transformers, the replicas' need both (through the engine)."""
    for role in ("gateway", "drafter", "verifier"):
        folder = ROOT / "services" / role
        assert (folder / "specdec" / role / "__init__.py").is_file()
        assert (folder / "pyproject.toml").is_file() and (folder / "Dockerfile").is_file()
    gateway = _requirements("gateway")
    assert "specdec-common" in gateway
    assert not {"torch", "transformers", "specdec-replica"} & set(gateway), gateway
    for role in ("drafter", "verifier"):
        assert {"torch", "transformers", "specdec-replica"} <= set(_requirements(role))


def test_the_package_roots_are_named_once_for_every_import_aware_tool():
    """`specdec` is one namespace over several package roots (a distribution's folder that
    holds a `specdec/` folder and a pyproject.toml). The type checkers do not run setuptools'
    editable finders, so the root pyproject.toml names the roots for them: mypy's
    mypy_path and pyright's extraPaths, each exactly the roots there are, and no folder
    named specdec holds an __init__.py (which would hide the other roots)."""
    import tomllib

    found = [*ROOT.glob("*/pyproject.toml"), *ROOT.glob("*/*/pyproject.toml")]
    roots = sorted(
        str(f.parent.relative_to(ROOT))
        for f in found
        if (f.parent / "specdec").is_dir() and not f.relative_to(ROOT).parts[0].startswith(".")
    )
    assert {"sdk", "tools", "services/gateway", "services/drafter", "services/verifier"} <= set(
        roots
    ), roots
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert sorted(settings["mypy"]["mypy_path"]) == roots
    assert sorted(settings["pyright"]["extraPaths"]) == roots
    for root in roots:
        assert not (ROOT / root / "specdec" / "__init__.py").exists(), root


def test_specdec_serve_runs_the_services_installed_beside_it():
    """Each service registers itself (the "specdec.services" entry points); a checkout's
    install has all three."""
    from specdec.serve import installed

    assert sorted(installed()) == ["drafter", "gateway", "verifier"]
