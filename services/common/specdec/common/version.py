"""A model directory's version id: `specdec_version.json`, written by `specdec distill`.

A drafter (or verifier) reports the version in its Info (ModelInfo.model_version) and as
the label of one gauge, ``specdec_<role>_model_version_info{model_version="..."} 1``, so
that a pool serving two versions side by side can be told apart, and the gateway can
route a share of new sessions to one of them (--drafter-canary) and count acceptance per
version. A model without the file (a hub id, a GGUF file, a directory never distilled)
has the version "".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import Gauge

from specdec.common.settings import ConfigError

VERSION_FILE = "specdec_version.json"
# What a version id may hold: it goes into metric labels, flags and file names.
VERSION_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")

_GAUGES: dict[str, Gauge] = {}


def check_version(version: str) -> str:
    """The version id if well formed, else ValueError naming the rule."""
    if not VERSION_PATTERN.fullmatch(version):
        raise ValueError(
            f"version {version!r} must be 1-64 characters of letters, digits and ._+- "
            "starting with a letter or digit"
        )
    return version


def read_model_version(model: str, flag: str = "--model") -> str:
    """The version of the model at `model` (a directory, hub id or GGUF path; a head
    drafter's head folder, `flag` --head): the "version" field of its
    specdec_version.json, "" when it has none. A file that is there but malformed stops
    start-up (ConfigError naming `flag` and the file)."""
    path = Path(model) / VERSION_FILE
    if not path.is_file():
        return ""
    try:
        version = json.loads(path.read_text())["version"]
        if not isinstance(version, str):
            raise TypeError("version is not a string")
        return check_version(version)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{flag}: {path}: no valid version id ({e})") from None


def note_model_version(role: str, version: str) -> None:
    """Set specdec_<role>_model_version_info{model_version=version} to 1."""
    gauge = _GAUGES.get(role)
    if gauge is None:
        gauge = _GAUGES[role] = Gauge(
            f"specdec_{role}_model_version_info",
            "The model version this replica serves (specdec_version.json; empty: none)",
            ["model_version"],
        )
    gauge.labels(model_version=version).set(1)
