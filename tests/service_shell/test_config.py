"""service_shell.config: one boolean syntax, typed env readers whose errors name flag and
variable, and the variables each parser declares."""
from __future__ import annotations

import argparse

import pytest

from service_shell.config import (ConfigError, add_bool_flag, add_flag, add_list_flag,
                                  declared_variables, env_bool, env_choice, parse_bool)


@pytest.mark.parametrize("text, value", [("1", True), ("TRUE", True), (" yes ", True),
                                         ("on", True), ("0", False), ("False", False),
                                         ("no", False), ("off", False), ("", False)])
def test_parse_bool(text, value) -> None:
    assert parse_bool(text) is value


def test_env_readers_name_flag_and_variable(monkeypatch) -> None:
    monkeypatch.delenv("PREFIXCACHE_X", raising=False)
    assert env_bool("X", "--x") is None and env_choice("X", "--x", ("a", "b"), "a") == "a"
    monkeypatch.setenv("PREFIXCACHE_X", "maybe")
    with pytest.raises(ConfigError, match=r"--x: 'maybe' is not a boolean.*\(from PREFIXCACHE_X\)"):
        env_bool("X", "--x")
    with pytest.raises(ConfigError, match=r"--x: invalid choice 'maybe' \(from PREFIXCACHE_X\)"):
        env_choice("X", "--x", ("a", "b"), "a")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t")
    add_flag(p, "--n", "N", 3, "a number", type=int)
    add_flag(p, "--mode", "MODE", "a", "a mode", choices=["a", "b"])
    add_flag(p, "--seconds", "SECONDS", 1.0, "a duration", type=float)
    add_bool_flag(p, "--switch", "SWITCH", "a switch", "off")
    add_list_flag(p, "--item", "ITEMS", "V", "an item")
    return p


def test_flags_fall_back_to_their_variable(monkeypatch) -> None:
    for name in ("N", "MODE", "SECONDS", "SWITCH", "ITEMS"):
        monkeypatch.delenv(f"PREFIXCACHE_{name}", raising=False)
    args = parser().parse_args([])
    assert (args.n, args.mode, args.seconds, args.switch, args.item) == (3, "a", 1.0, None, None)
    for name, value in {"N": "5", "MODE": "b", "SECONDS": "2.5", "SWITCH": "yes",
                        "ITEMS": "x, y"}.items():
        monkeypatch.setenv(f"PREFIXCACHE_{name}", value)
    args = parser().parse_args([])
    assert (args.n, args.mode, args.seconds, args.switch, args.item) == (5, "b", 2.5, True,
                                                                        ["x", "y"])
    assert parser().parse_args(["--n", "7", "--no-switch"]).n == 7
    assert declared_variables(parser()) == {
        "PREFIXCACHE_N": "--n", "PREFIXCACHE_MODE": "--mode", "PREFIXCACHE_SECONDS": "--seconds",
        "PREFIXCACHE_SWITCH": "--switch", "PREFIXCACHE_ITEMS": "--item"}


@pytest.mark.parametrize("name, value, message", [
    ("N", "abc", "argument --n: invalid int value 'abc' (from PREFIXCACHE_N)"),
    ("MODE", "c", "argument --mode: invalid choice 'c' (from PREFIXCACHE_MODE): choose from a, b"),
    ("SECONDS", "inf", "(from PREFIXCACHE_SECONDS)"),
    ("SWITCH", "2", "--switch: '2' is not a boolean"),
])
def test_a_bad_variable_is_a_usage_error_naming_flag_and_variable(monkeypatch, capsys, name,
                                                                  value, message) -> None:
    monkeypatch.setenv(f"PREFIXCACHE_{name}", value)
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args([])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_bad_command_line_value_keeps_argparse_s_message(monkeypatch, capsys) -> None:
    monkeypatch.setenv("PREFIXCACHE_N", "4")
    with pytest.raises(SystemExit):
        parser().parse_args(["--n", "x"])
    err = capsys.readouterr().err
    assert "argument --n: invalid int value: 'x'" in err and "PREFIXCACHE" not in err
