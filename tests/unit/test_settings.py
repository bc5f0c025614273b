"""Settings declared once: a config dataclass's fields make its flags, variables and defaults
(specdec.common.settings)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

import pytest

from specdec.cli import build_parser
from specdec.common.settings import (
    SETTING,
    ConfigError,
    Setting,
    add_settings,
    positive,
    read_settings,
    setting,
    settings_group,
)
from specdec.drafter.config import DrafterConfig
from specdec.gateway.config import GatewayConfig
from specdec.gateway.round.policy import ADAPTIVE
from specdec.v1 import gateway_pb2
from specdec.verifier.config import VerifierConfig


def _pair(text: str) -> tuple[str, str]:
    left, sep, right = text.partition("/")
    if not sep:
        raise ValueError("expected A/B")
    return left, right


@dataclass(frozen=True)
class Twice:
    extra_a: str = setting("x", "said twice")

    def build(self) -> str:
        return self.extra_a * 2


@dataclass(frozen=True)
class Example:
    name: str = setting(help="a required name")
    max_things: int = setting(3, "most things", check=positive)
    ratio: float = setting(0.5, "a ratio")
    loud: bool = setting(False, "speak up")
    where: str | None = setting(None, "a place (empty: none)", flag="--place", blank=True)
    pair: tuple[str, str] = setting(("a", "b"), "A/B", convert=_pair, shown="a/b")
    extra: str = settings_group(Twice, default="")
    internal: int = 7  # no flag


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("SPECDEC_"):
            monkeypatch.delenv(name)
    return monkeypatch


def example(*argv: str) -> Example:
    parser = argparse.ArgumentParser()
    add_settings(parser, Example)
    return Example(**read_settings(Example, parser.parse_args(list(argv))))


def test_a_field_is_a_flag_and_a_variable_with_its_default(clean_env):
    cfg = example("--name", "n")
    assert cfg == Example(name="n", extra="xx")
    parser = argparse.ArgumentParser()
    add_settings(parser, Example)
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert helps["--max-things"] == "most things [env SPECDEC_MAX_THINGS; default 3]"
    assert helps["--loud"] == "speak up [env SPECDEC_LOUD; default false]"
    assert helps["--place"] == "a place (empty: none) [env SPECDEC_PLACE; default None]"
    assert helps["--pair"] == "A/B [env SPECDEC_PAIR; default 'a/b']"
    assert "--internal" not in helps and "--where" not in helps


def test_values_are_read_by_the_fields_types(clean_env):
    cfg = example(
        "--name", "n", "--max-things", "9", "--ratio", "0.25", "--loud", "--place", "p",
        "--pair", "c/d", "--extra-a", "y",
    )  # fmt: skip
    assert (cfg.max_things, cfg.ratio, cfg.loud, cfg.where, cfg.pair) == (
        9,
        0.25,
        True,
        "p",
        ("c", "d"),
    )
    assert cfg.extra == "yy"
    assert example("--name", "n", "--place", "").where is None  # blank: the field's default


def test_the_variable_sets_it_and_the_flag_wins(clean_env):
    clean_env.setenv("SPECDEC_MAX_THINGS", "5")
    clean_env.setenv("SPECDEC_LOUD", "true")
    clean_env.setenv("SPECDEC_PAIR", "e/f")
    cfg = example("--name", "n")
    assert (cfg.max_things, cfg.loud, cfg.pair) == (5, True, ("e", "f"))
    cfg = example("--name", "n", "--max-things", "6", "--no-loud")
    assert (cfg.max_things, cfg.loud) == (6, False)


@pytest.mark.parametrize(
    "argv, message",
    [
        ((), "--name / SPECDEC_NAME is required"),
        (("--name", "n", "--max-things", "0"), "--max-things / SPECDEC_MAX_THINGS: must be > 0"),
        (("--name", "n", "--ratio", "lots"), "--ratio / SPECDEC_RATIO: cannot read 'lots'"),
        (("--name", "n", "--pair", "ab"), "--pair / SPECDEC_PAIR: cannot read 'ab': expected A/B"),
    ],
)  # fmt: skip
def test_a_bad_value_names_the_flag_and_the_variable(clean_env, argv, message):
    with pytest.raises(ConfigError) as e:
        example(*argv)
    assert str(e.value).startswith(message)


def test_a_type_without_a_conversion_is_refused_when_read():
    @dataclass(frozen=True)
    class Bad:
        things: list[int] = setting(help="no conversion for this type")

    parser = argparse.ArgumentParser()
    add_settings(parser, Bad)
    with pytest.raises(TypeError, match="'things'"):
        read_settings(Bad, parser.parse_args(["--things", "1"]))


def _declared(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if isinstance(f.metadata.get(SETTING), Setting)]


@pytest.mark.parametrize(
    "role, cls, required",
    [
        ("gateway", GatewayConfig, ["--drafter", "h:1", "--verifier", "h:2"]),
        ("drafter", DrafterConfig, ["--model", "m"]),
        ("verifier", VerifierConfig, ["--model", "m"]),
    ],
)
def test_the_parsed_defaults_are_the_fields_defaults(clean_env, role, cls, required):
    """Each setting's flag default, read back, is its field's default (the role's port
    aside): the two cannot drift, since one declaration makes both."""
    args = build_parser().parse_args(["serve", role, *required])
    parsed = cls.from_args(args)
    for f in _declared(cls):
        if f.default is dataclasses.MISSING or (f.name == "port" and role != "gateway"):
            continue
        assert getattr(parsed, f.name) == f.default, f.name
    assert parsed.tls is None


def test_the_gateway_reads_its_enum_settings_by_name(clean_env):
    args = build_parser().parse_args(["serve", "gateway", "--drafter", "h:1", "--verifier", "h:2"])
    cfg = GatewayConfig.from_args(args)
    assert (cfg.k_policy, cfg.method) == (ADAPTIVE, gateway_pb2.SPECULATION_METHOD_HYBRID)
    assert (cfg.drafters, cfg.redis_url, cfg.auth_tokens, cfg.drafter_canary) == (
        ("h:1",),
        None,
        frozenset(),
        None,
    )
