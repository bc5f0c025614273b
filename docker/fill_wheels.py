"""Fill a folder with the wheels an image installs, for the image's own Python.

`pip download` evaluates dependency markers against the Python that runs it, even with
--python-version, so a host on 3.11.7 skips what a 3.11.2 image needs (redis wants
async-timeout only on python_full_version < 3.11.3). This runs `pip download` with the host's
index settings, then reads every downloaded wheel's Requires-Dist, evaluates the markers for
the image's Python, and downloads what is still missing until nothing is.

Usage: python docker/fill_wheels.py DEST IMAGE_PYTHON_VERSION REQUIREMENT...
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename


def download(dest: Path, requirements: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest)]
    subprocess.run([*cmd, *requirements], check=True)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(z.read(name).decode())
    return [Requirement(r) for r in metadata.get_all("Requires-Dist") or []]


def missing(dest: Path, environment: dict[str, str]) -> list[str]:
    """Requirements of the wheels in dest that hold in `environment` and that no wheel meets."""
    wheels = {}
    for w in dest.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(w.name)
        wheels[name] = version
    needed = []
    for w in dest.glob("*.whl"):
        for req in wheel_requirements(w):
            env = {**environment, "extra": ""}
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            have = wheels.get(canonicalize_name(req.name))
            if have is None or not req.specifier.contains(have, prereleases=True):
                needed.append(str(Requirement(f"{req.name}{req.specifier}")))
    return sorted(set(needed))


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    dest, version, requirements = Path(argv[0]), argv[1], argv[2:]
    dest.mkdir(parents=True, exist_ok=True)
    environment = default_environment()
    environment.update(python_full_version=version, python_version=".".join(version.split(".")[:2]))
    download(dest, requirements)
    for _ in range(10):
        needed = missing(dest, environment)
        if not needed:
            return 0
        print(f"fill_wheels: for Python {version} also: {' '.join(needed)}", file=sys.stderr)
        download(dest, needed)
    print(f"fill_wheels: still missing after 10 rounds: {' '.join(needed)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
