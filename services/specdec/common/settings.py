"""Settings read once at start-up from flags and environment variables: the helpers.

Every setting has a flag (``--max-cached-tokens``) and an environment variable
(``SPECDEC_MAX_CACHED_TOKENS``); the flag wins. A boolean setting is a pair of flags,
``--ssd`` / ``--no-ssd``, as every boolean of the ``specdec`` command, and its variable
reads ``true`` or ``false``. A malformed value stops start-up with a ``ConfigError`` that
names the setting. Torch-free and import-free (a leaf): every
service's configuration, and the TLS settings (specdec.common.tls), build on it.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
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
    """A flag whose default comes from its environment variable, then `default`.

    A bool `default` makes a switch: `--flag` / `--no-flag`, the variable `true`/`false`
    (read by `parse_value(args, flag, boolean)`, which names a malformed one)."""
    env = env_name(flag)
    if isinstance(default, bool):
        kw.setdefault("action", argparse.BooleanOptionalAction)
    parser.add_argument(
        flag,
        default=os.environ.get(env, default),
        help=f"{help} [env {env}; default {_shown(default)}]",
        **kw,
    )


def _shown(default: Any) -> str:
    return str(default).lower() if isinstance(default, bool) else repr(default)


class SettingsParser(argparse.ArgumentParser):
    """The parser of a service's settings (`specdec serve ROLE`).

    It still reads the value form of a switch that older releases took (`--ssd true`,
    `--trust-remote-code=false`) as `--ssd` / `--no-trust-remote-code`, with a warning on
    stderr; that form goes in the next release."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        if args is not None:
            args = self._old_switch_values(list(args))
        return super().parse_known_args(args, namespace)

    def _old_switch_values(self, args: list[str]) -> list[str]:
        switches = {
            a.option_strings[0]
            for a in self._actions
            if isinstance(a, argparse.BooleanOptionalAction)
        }
        out: list[str] = []
        i = 0
        while i < len(args):
            flag, eq, value = args[i].partition("=")
            if flag in switches and not eq and i + 1 < len(args) and _is_boolean(args[i + 1]):
                value, eq = args[i + 1], "="
                i += 1
            if flag in switches and eq and _is_boolean(value):
                new = flag if boolean(value) else "--no-" + flag[2:]
                print(
                    f"specdec: `{flag} {value}` is deprecated and goes in the next release: "
                    f"write `{new}`",
                    file=sys.stderr,
                )
                out.append(new)
            else:
                out.append(args[i])
            i += 1
        return out


def _is_boolean(text: str) -> bool:
    try:
        boolean(text)
    except ValueError:
        return False
    return True


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


def one_of(choices: tuple[str, ...]) -> Callable[[str], str | None]:
    """A parse_value check: the value is one of choices."""
    return lambda v: None if v in choices else f"must be one of {choices}"


def positive(value: int) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: int) -> str | None:
    return None if value >= 0 else "must be >= 0"


def port_number(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a port number in [0, 65535] (0 = any free)"
