"""Settings read once at start-up from flags and environment variables: the helpers.

Every setting has a flag (``--max-cached-tokens``) and an environment variable
(``SPECDEC_MAX_CACHED_TOKENS``); the flag wins. A boolean setting is a pair of flags,
``--ssd`` / ``--no-ssd``, as every boolean of the ``specdec`` command, and its variable
reads ``true`` or ``false``. A malformed value stops start-up with a ``ConfigError`` that
names the setting. Torch-free and import-free (a leaf): every
service's configuration, and the TLS settings (specdec.common.tls), build on it.

Each setting is declared once, as a field of its service's config dataclass
(`setting(default, help, ...)`): its flag, variable, default, conversion and check follow
from the field, and the CLI reference (docs/reference/cli.md) is generated from the
parsers these fields build. A check across several settings stays in the config's
`from_args`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, dataclass, field, fields
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

    def parse_known_args(
        self, args: Iterable[str] | None = None, namespace: Any = None
    ) -> tuple[Any, list[str]]:
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


def parse_value(
    args: argparse.Namespace,
    flag: str,
    convert: Callable[[str], T],
    check: Callable[[T], str | None] | None = None,
) -> T:
    """Convert args.<flag> with `convert`, then validate with `check(value) -> error or None`."""
    raw = getattr(args, _dest(flag))
    where = f"{flag} / {env_name(flag)}"
    if raw is None:
        raise ConfigError(f"{where} is required")
    try:
        value = convert(raw) if isinstance(raw, str) else raw
    except ConfigError:
        raise  # the conversion named the setting itself
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: cannot read {raw!r}: {e}") from None
    if check is not None:
        problem = check(value)
        if problem:
            raise invalid(flag, problem, raw)
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


class one_of:  # a check, used as a function: check=one_of(CHOICES)
    """A parse_value check: the value is one of choices. A setting so checked lists them
    in --help, as its flag's metavar."""

    def __init__(self, choices: Iterable[str]) -> None:
        self.choices = tuple(choices)

    def __call__(self, value: str) -> str | None:
        return None if value in self.choices else f"must be one of {self.choices}"


def positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def port_number(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a port number in [0, 65535] (0 = any free)"


# -- Settings declared once: a config dataclass's fields make its flags --------------------
#
# A field declared with `setting(default, help, ...)` is a flag named after it
# (`max_cached_tokens` -> --max-cached-tokens, SPECDEC_MAX_CACHED_TOKENS), read with the
# conversion its annotation names (bool, int, float, str, or one of them | None) unless
# `convert` says, and validated by `check`. A field declared with `settings_group` is
# several flags that build one value (TLS). A field without either is no flag.
# `add_settings` declares the flags in field order; `read_settings` reads them back into the
# fields' values.

SETTING = "specdec.setting"


class _AsField:
    """`setting(shown=...)` left out: the flag's default is the field's."""

    def __repr__(self) -> str:
        return "AS_FIELD"


AS_FIELD: Any = _AsField()


@dataclass(frozen=True)
class Setting:
    """How one field is a flag (see `setting`)."""

    help: str
    flag: str = ""  # default: --<field name with dashes>
    convert: Callable[[str], Any] | None = None  # default: from the field's type
    check: Callable[[Any], str | None] | None = None
    shown: Any = AS_FIELD  # the flag's default when it is written otherwise than the field's
    blank: bool = False  # an empty (or unset) value means the field's default, e.g. None: off
    choices: tuple[str, ...] = ()  # the values a user writes, listed in --help

    @property
    def listed(self) -> tuple[str, ...]:
        """The values --help lists: `choices`, or those of a `one_of` check."""
        return self.choices or getattr(self.check, "choices", ())


@dataclass(frozen=True)
class SettingsGroup:
    """Several flags that build one field's value: the setting fields of the dataclass
    `flags`, read into one, whose `build()` makes the value (see `settings_group`)."""

    flags: type


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    flag: str = "",
    convert: Callable[[str], Any] | None = None,
    check: Callable[[Any], str | None] | None = None,
    shown: Any = AS_FIELD,
    blank: bool = False,
    choices: tuple[str, ...] = (),
) -> Any:
    """A dataclass field that is also a flag and an environment variable.

    - default: the field's default (none: the flag is required);
    - help: the flag's help;
    - flag: its name when not the field's;
    - convert: str -> value, where the field's type is not bool, int, float or str (or
      one of them | None);
    - check: value -> the problem, or None;
    - shown: the flag's default where the field's is not how a user writes it
      (`"adaptive"` for a policy held as an enum number);
    - blank: an empty value means the field's default;
    - choices: the values a user may write, listed in --help (the check, unless `check` or
      `convert` says otherwise: `convert` reads them into the field's type)."""
    if choices and check is None and convert is None:
        check = one_of(choices)
    meta = Setting(help, flag, convert, check, shown, blank, tuple(choices))
    return field(default=default, metadata={SETTING: meta})


def settings_group(flags: type, default: Any = None) -> Any:
    """A dataclass field whose value several flags build: `flags` is a dataclass whose
    fields are declared with `setting` and whose `build()` returns the value (TLS: the
    certificate flags make one ServerTls, or None)."""
    return field(default=default, metadata={SETTING: SettingsGroup(flags)})


def _flag(f: Field[Any]) -> str:
    """The flag of a field declared with `setting`."""
    return f.metadata[SETTING].flag or "--" + f.name.replace("_", "-")


def _declared(cls: type) -> list[tuple[Field[Any], Setting | SettingsGroup]]:
    return [(f, f.metadata[SETTING]) for f in fields(cls) if SETTING in f.metadata]


def add_settings(parser: argparse.ArgumentParser, cls: type, **defaults: Any) -> None:
    """Declare the flags of `cls`'s setting fields on `parser`, in field order; `defaults`
    overrides a field's default by name (a replica's port is its role's)."""
    for f, s in _declared(cls):
        if isinstance(s, SettingsGroup):
            add_settings(parser, s.flags)
            continue
        if f.name in defaults:
            default = defaults[f.name]
        elif s.shown is not AS_FIELD:
            default = s.shown
        else:
            default = None if f.default is MISSING else f.default
        listed = {"metavar": "{" + ",".join(s.listed) + "}"} if s.listed else {}
        add_setting(parser, _flag(f), s.help, default, **listed)


@dataclass(frozen=True)
class Described:
    """One setting as a reference page shows it (specdec.tools.docs.configuration)."""

    flag: str
    env: str
    default: Any  # MISSING: required
    help: str


def described(cls: type) -> list[Described]:
    """`cls`'s settings in field order, groups flattened, each with its flag, variable,
    default (as the flag shows it) and help: what `add_settings` declares."""
    out: list[Described] = []
    for f, s in _declared(cls):
        if isinstance(s, SettingsGroup):
            out += described(s.flags)
            continue
        default = f.default if s.shown is AS_FIELD else s.shown
        out.append(Described(_flag(f), env_name(_flag(f)), default, s.help))
    return out


def read_settings(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of `cls`'s setting fields from parsed `args`, by field name; a malformed
    one raises ConfigError naming its flag and variable."""
    values: dict[str, Any] = {}
    for f, s in _declared(cls):
        if isinstance(s, SettingsGroup):
            values[f.name] = s.flags(**read_settings(s.flags, args)).build()
            continue
        flag = _flag(f)
        if s.blank and getattr(args, _dest(flag)) in (None, ""):
            values[f.name] = f.default
            continue
        values[f.name] = parse_value(args, flag, s.convert or _conversion(f), s.check)
    return values


_CONVERSIONS: dict[str, Callable[[str], Any]] = {
    "bool": boolean,
    "int": int,
    "float": float,
    "str": str,
}


def _conversion(f: Field[Any]) -> Callable[[str], Any]:
    """The conversion the field's annotation names (`int`, `str | None`, ...)."""
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    name = name.removesuffix(" | None")
    if name in _CONVERSIONS:
        return _CONVERSIONS[name]
    raise TypeError(f"setting {f.name!r}: its type {f.type!r} needs `convert`")


def invalid(flag: str, problem: str, raw: Any) -> ConfigError:
    """The ConfigError of a value a check refuses (parse_value's, or one across settings
    in a config's from_args): `--flag / SPECDEC_FLAG: problem (got 'raw')`."""
    return ConfigError(f"{flag} / {env_name(flag)}: {problem} (got {raw!r})")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")
