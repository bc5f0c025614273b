"""Settings read once at start-up from flags and environment variables: the helpers.

Every setting has a flag (``--max-cached-tokens``) and an environment variable
(``SPECDEC_MAX_CACHED_TOKENS``); the flag wins. A malformed value stops start-up with a
``ConfigError`` that names the setting. Torch-free and import-free (a leaf): every
service's configuration, and the TLS settings (specdec.common.tls), build on it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "SPECDEC_"


class ConfigError(ValueError):
    """A configuration value is missing or malformed; the message names it."""


def env_name(flag: str) -> str:
    """--max-cached-tokens -> SPECDEC_MAX_CACHED_TOKENS."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def add_setting(
    parser: argparse.ArgumentParser, flag: str, help: str, default: Any = None, **kw: Any
) -> None:
    """A flag whose default comes from its environment variable, then `default`."""
    env = env_name(flag)
    parser.add_argument(
        flag,
        default=os.environ.get(env, default),
        help=f"{help} [env {env}; default {default!r}]",
        **kw,
    )


def parse_value(args: argparse.Namespace, flag: str, convert: Callable[[str], T], check=None) -> T:
    """Convert args.<flag> with `convert`, then validate with `check(value) -> error or None`."""
    raw = getattr(args, flag.lstrip("-").replace("-", "_"))
    where = f"{flag} / {env_name(flag)}"
    if raw is None:
        raise ConfigError(f"{where} is required")
    try:
        value = convert(raw) if isinstance(raw, str) else raw
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read {raw!r}: {e}") from None
    if check is not None:
        problem = check(value)
        if problem:
            raise ConfigError(f"{where}: {problem} (got {raw!r})")
    return value


def boolean(value: str | bool) -> bool:
    """'true'/'false' (also 1/0, yes/no, on/off) -> bool (ValueError otherwise)."""
    if isinstance(value, bool):
        return value
    text = value.strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def positive(value: int) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: int) -> str | None:
    return None if value >= 0 else "must be >= 0"


def port_number(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a port number in [0, 65535] (0 = any free)"
