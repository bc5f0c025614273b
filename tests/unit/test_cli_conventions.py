"""One convention across every `specdec` command: walks every parser, `serve drafter |
verifier | gateway` included.

- A boolean is a pair of flags, `--flag` / `--no-flag` (argparse.BooleanOptionalAction),
  never a lone `--flag`, a lone `--no-flag`, or a flag that takes true/false.
- A setting has one name in `up`, `demo`, `bench` and `serve`.
- `specdec --version` prints the package's version.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

from specdec.tools.docs.cli import build_parser, commands

LONE_FLAGS = (argparse._StoreTrueAction, argparse._StoreFalseAction)
BOOLEAN_WORDS = {"true", "false"}


def _options():
    """(command, action) for every option of every command; parsers built with SPECDEC_*
    unset, so a default is the code's."""
    for command in commands(build_parser()):
        for action in command.parser._actions:
            if action.option_strings and not isinstance(
                action, (argparse._HelpAction, argparse._VersionAction)
            ):
                yield command.name, action


def _is_boolean(action: argparse.Action) -> bool:
    if isinstance(action, (*LONE_FLAGS, argparse.BooleanOptionalAction)):
        return True
    if isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool):
        return True
    if isinstance(action.default, bool):
        return True
    choices = {str(c).lower() for c in action.choices or ()}
    return bool(choices) and choices <= BOOLEAN_WORDS | {"1", "0", "yes", "no", "on", "off"}


def test_the_walk_sees_every_command():
    names = {c.name for c in commands(build_parser())}
    for name in ("generate", "loadtest", "up", "demo", "bench", "distill", "models install"):
        assert f"specdec {name}" in names
    for role in ("drafter", "verifier", "gateway"):
        assert f"specdec serve {role}" in names
    booleans = [(c, a.option_strings[0]) for c, a in _options() if _is_boolean(a)]
    # the walk finds the booleans of every kind of parser: SDK, services, tools
    for where in (
        ("specdec generate", "--ssd"),
        ("specdec serve gateway", "--ssd"),
        ("specdec serve drafter", "--trust-remote-code"),
        ("specdec up", "--ssd"),
        ("specdec demo", "--pin"),
        ("specdec bench", "--pin"),
    ):
        assert where in booleans


def test_every_boolean_is_a_flag_pair():
    wrong = []
    for name, action in _options():
        if not _is_boolean(action):
            continue
        flag = action.option_strings[0]
        if not isinstance(action, argparse.BooleanOptionalAction):
            wrong.append(f"{name} {flag}: {type(action).__name__}, not --flag/--no-flag")
        elif action.option_strings != [flag, "--no-" + flag[2:]] or flag.startswith("--no-"):
            wrong.append(f"{name} {action.option_strings}: not exactly [--flag, --no-flag]")
    assert not wrong, "\n".join(wrong)


def test_no_negative_flag_stands_alone():
    """A `--no-x` flag is only ever the negative half of a `--x` / `--no-x` pair."""
    for name, action in _options():
        for flag in action.option_strings:
            if flag.startswith("--no-"):
                assert isinstance(action, argparse.BooleanOptionalAction), f"{name} {flag}"
                assert action.option_strings[0] == "--" + flag[5:], f"{name} {flag}"


def test_no_flag_takes_true_or_false():
    """The helps say nothing of a true/false value: that is the environment's spelling."""
    for name, action in _options():
        if isinstance(action, argparse.BooleanOptionalAction):
            continue
        help = (action.help or "").lower()
        assert "true/false" not in help and "true or false" not in help, (name, action.help)


def _flags(command: str) -> dict[str, argparse.Action]:
    for c in commands(build_parser()):
        if c.name == command:
            return {s: a for a in c.parser._actions for s in a.option_strings}
    raise AssertionError(command)


def test_one_name_per_setting():
    """What `up` passes to a service is spelled as that service's setting; `demo` and
    `bench` set the draft length per request (--k), so they have no --default-k."""
    up, demo, bench = _flags("specdec up"), _flags("specdec demo"), _flags("specdec bench")
    gateway, drafter = _flags("specdec serve gateway"), _flags("specdec serve drafter")
    for flag in ("--default-k", "--ssd", "--method", "--http-port", "--served-model-name"):
        assert flag in up and flag in gateway, flag
        assert type(up[flag]) is type(gateway[flag]), flag  # a switch in both, or a value
    assert "--quantize" in up and "--quantize" in drafter
    assert up["--quantize"].choices == ("none", "int8")
    for tool in (demo, bench):
        assert "--default-k" not in tool and "--k" in tool
        assert "--gateway-flags" not in tool or tool["--gateway-flags"].help == argparse.SUPPRESS
    for tool in (up, demo, bench):
        for role in ("drafter", "verifier", "gateway"):
            action = tool[f"--{role}-arg"]
            assert isinstance(action, argparse._AppendAction), role


def test_long_commands_take_progress():
    for command in ("specdec bench", "specdec loadtest", "specdec distill"):
        action = _flags(command)["--progress"]
        assert isinstance(action, argparse.BooleanOptionalAction) and action.default is None


def test_version():
    out = subprocess.run(
        [sys.executable, "-m", "specdec", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["specdec", version("specdec-sdk")]


@pytest.mark.parametrize("argv", [["serve", "gateway", "--ssd", "true"]])
def test_old_value_form_warns(argv, capsys):
    args = build_parser().parse_args([*argv, "--drafter", "h:1", "--verifier", "h:2"])
    assert args.ssd is True
    assert "deprecated" in capsys.readouterr().err


def test_every_help_states_the_defaults():
    """`--help` of every command states each option's default (an option without one, or a
    switch that is off, says nothing)."""
    missing = []
    for command in commands(build_parser()):
        formatter = command.parser._get_formatter()
        for action in command.parser._actions:
            switch = isinstance(action, argparse.BooleanOptionalAction)
            if (
                not action.option_strings
                or (action.nargs == 0 and not switch)
                or action.default in (None, argparse.SUPPRESS, "", [])
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))
            ):
                continue
            text = formatter._get_help_string(action) or ""
            if "default" not in text.lower():
                missing.append(f"{command.name} {action.option_strings[0]}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize(
    ("path", "flag", "listed"),
    [
        (("serve", "drafter"), "--dtype", "{auto,float32,bfloat16,float16,fastest}"),
        (("serve", "drafter"), "--quantize", "{none,int8}"),
        (("serve", "verifier"), "--engine", "{auto,dense,paged,llama.cpp}"),
        (("serve", "gateway"), "--method", "{model,ngram,suffix,hybrid}"),
        (("serve", "gateway"), "--k-policy", "{fixed,adaptive}"),
        (("serve", "gateway"), "--suffix-cache-scope", "{global,tenant,off}"),
        (("up",), "--dtype", "{auto,float32,bfloat16,float16,fastest}"),
        (("up",), "--draft-dtype", "{auto,float32,bfloat16,float16,fastest}"),
    ],
)
def test_a_setting_with_choices_lists_them(path, flag, listed):
    parser = {c.parser.prog.split(" ", 1)[1]: c.parser for c in commands(build_parser())}
    help_text = parser[" ".join(path)].format_help()
    assert f"{flag} {listed}" in help_text


def test_up_runs_an_int8_drafter_with_the_default_dtype(tmp_path):
    """`up --quantize int8` with the default --dtype fastest: the drafter runs in float32
    (int8 needs it) and the verifier keeps fastest; --draft-dtype says otherwise."""
    from specdec.drafter.config import DrafterConfig
    from specdec.tools.stack import LocalStack
    from specdec.verifier.config import VerifierConfig

    up = ["up", "--draft-model", "d", "--target-model", "t", "--quantize", "int8"]
    args = build_parser().parse_args(up)
    stack = LocalStack(args)
    drafter = build_parser().parse_args(stack.replica_argv("drafter", "d", None, 1))
    config = DrafterConfig.from_args(drafter)
    assert (config.dtype, config.quantize) == ("float32", "int8")
    verifier = build_parser().parse_args(stack.replica_argv("verifier", "t", None, 1))
    assert VerifierConfig.from_args(verifier).dtype == "fastest"
    args = build_parser().parse_args([*up[:5], "--draft-dtype", "bfloat16"])
    drafter = build_parser().parse_args(LocalStack(args).replica_argv("drafter", "d", None, 1))
    assert DrafterConfig.from_args(drafter).dtype == "bfloat16"
