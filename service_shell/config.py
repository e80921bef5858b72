"""The one configuration path of the services: every flag falls back to one PREFIXCACHE_*
variable, read here and nowhere else (libraries take parameters; each `__main__` passes them
what its parser read).

- One name per setting: `add_flag(parser, "--x-y", "X_Y", ...)` is `--x-y` or `$PREFIXCACHE_X_Y`,
  and the parser remembers the pair (`declared_variables(parser)`: the variables a service
  reads, which tests/test_config_docs.py checks against the docs' lists).
- One boolean syntax: `parse_bool` takes 1/true/yes/on and 0/false/no/off (any case, "" is
  false); anything else is an error.
- A bad value from the environment is a usage error (exit 2) naming the flag and the variable:
  `argument --page-size: invalid int value 'abc' (from PREFIXCACHE_PAGE_SIZE)`. That includes
  `choices`, which argparse itself never checks on a default.
"""
from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

ENV_PREFIX = "PREFIXCACHE_"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
NATIVE_MODES = ("auto", "on", "off")

# Variables a parser declared, flag by variable: kept on the parser object itself, so each
# service's parser answers for itself.
_DECLARED = "_prefixcache_variables"


class ConfigError(ValueError):
    """A setting's value is not one it can take; the message names the flag and the variable."""


def variable(env: str) -> str:
    """The full variable name of a flag's `env` suffix ("PAGE_SIZE" -> "PREFIXCACHE_PAGE_SIZE")."""
    return env if env.startswith(ENV_PREFIX) else ENV_PREFIX + env


def env_text(env: str, environ: Mapping[str, str] | None = None) -> str | None:
    """$PREFIXCACHE_<env>, None when unset. The only read of the process environment for settings."""
    return (os.environ if environ is None else environ).get(variable(env))


def parse_bool(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off (any case, surrounding blanks ignored; "" is false)."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{text!r} is not a boolean: expected one of {', '.join(TRUE_WORDS)} or "
                     f"{', '.join(FALSE_WORDS[:-1])}")


def env_bool(env: str, flag: str, environ: Mapping[str, str] | None = None) -> bool | None:
    """$PREFIXCACHE_<env> as a boolean, None when unset; a bad value is a ConfigError naming
    `flag` and the variable."""
    text = env_text(env, environ)
    if text is None:
        return None
    try:
        return parse_bool(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {exc} (from {variable(env)})") from None


def env_choice(env: str, flag: str, choices: tuple[str, ...], default: str,
               environ: Mapping[str, str] | None = None) -> str:
    """$PREFIXCACHE_<env>, one of `choices` (default when unset); anything else is a
    ConfigError naming `flag` and the variable."""
    text = env_text(env, environ)
    if text is None:
        return default
    if text not in choices:
        raise ConfigError(f"{flag}: invalid choice {text!r} (from {variable(env)}): expected "
                          f"one of {', '.join(choices)}")
    return text


def env_list(env: str, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """$PREFIXCACHE_<env> as comma-separated items (blanks dropped), None when unset."""
    text = env_text(env, environ)
    return None if text is None else [s.strip() for s in text.split(",") if s.strip()]


def declare(parser: argparse.ArgumentParser, env: str, flag: str) -> None:
    """Records that `flag` of `parser` falls back to $PREFIXCACHE_<env>."""
    declared = parser.__dict__.setdefault(_DECLARED, {})
    declared[variable(env)] = flag


def declared_variables(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every PREFIXCACHE_* variable `parser` reads, with its flag (every flag that falls back to
    one is declared through this module's add_*_flag helpers)."""
    return dict(parser.__dict__.get(_DECLARED, {}))


def _from_env(convert: Callable[[str], Any], env: str, text: str,
              choices: Any = None) -> Callable[[str], Any]:
    """`convert`, which, given the environment's own `text` (argparse converts a string default
    only when the flag is not given), names the variable in its error and checks `choices`."""
    def from_env(value: str) -> Any:
        if value is not text:  # a command-line value: argparse's own messages and checks
            return convert(value)
        name = getattr(convert, "__name__", "value")
        try:
            out = convert(value)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (from {variable(env)})") from None
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                f"invalid {name} value {value!r} (from {variable(env)})") from None
        if choices is not None and out not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice {value!r} (from {variable(env)}): choose from "
                f"{', '.join(map(str, choices))}")
        return out
    from_env.__name__ = getattr(convert, "__name__", "value")
    return from_env


def finite_float(low: float = 0.0, high: float = math.inf):
    """An argparse type: a finite number in [low, high]. float() alone takes "nan" and "inf",
    which compare false with every bound (a NaN interval is a busy loop, an inf timeout never
    fires), and every float flag of the services is a duration, a weight or a size: >= 0."""
    def convert(text: str) -> float:
        value = float(text)  # ValueError: argparse says "invalid float value"
        if not (math.isfinite(value) and low <= value <= high):
            bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"must be a finite number {bounds}, got {text!r}")
        return value
    convert.__name__ = "float"
    return convert


def add_flag(parser: argparse.ArgumentParser, name: str, env: str, default: object, help: str,
             **kwargs: Any) -> argparse.Action:
    """`--name` with its default from $PREFIXCACHE_<env>, both named in its help; a bad value of
    the variable is a usage error naming both. `type=float` means `finite_float()`: finite and
    >= 0."""
    if kwargs.get("type") is float:
        kwargs["type"] = finite_float()
    text = env_text(env)
    if text is not None:
        kwargs["type"] = _from_env(kwargs.get("type") or str, env, text, kwargs.get("choices"))
    declare(parser, env, name)
    shown = "" if default is None else "; default %(default)s"
    # `text` itself, not an equal string: _from_env tells the environment's value by identity.
    return parser.add_argument(
        name, default=text if text is not None else (None if default is None else str(default)),
        help=f"{help} (env {variable(env)}{shown})", **kwargs)


def env_default(name: str, default: object) -> str | None:
    """A flag's default: $PREFIXCACHE_<name> when set, else `default`, as the text argparse
    converts with the flag's type (None stays None: "not set")."""
    value = env_text(name)
    if value is not None:
        return value
    return None if default is None else str(default)


def add_bool_flag(parser: argparse.ArgumentParser, name: str, env: str, help: str,
                  default_help: str) -> argparse.Action:
    """`--name` / `--no-name`, falling back to $PREFIXCACHE_<env> (`parse_bool`); None when
    neither is given (the caller fills the default, `default_help` says which). A bad value of the
    variable is a usage error naming both."""
    try:
        default = env_bool(env, name)
    except ConfigError as exc:
        parser.error(str(exc))
    declare(parser, env, name)
    return parser.add_argument(name, action=argparse.BooleanOptionalAction, default=default,
                               help=f"{help} (env {variable(env)}=1/0; default {default_help})")


def add_list_flag(parser: argparse.ArgumentParser, name: str, env: str, metavar: str,
                  help: str) -> argparse.Action:
    """A repeatable `--name VALUE` whose default is $PREFIXCACHE_<env>, comma separated."""
    declare(parser, env, name)
    return parser.add_argument(name, action="append", metavar=metavar, default=env_list(env),
                               help=f"{help}; repeatable (env {variable(env)}: "
                                    f"{metavar},{metavar})")


# Former names of settings, refused at start with the current one: old variable -> (new
# variable, its flag). A silently ignored old name would run with the default instead (for the L3
# key prefix: pages written under one prefix, looked up under another).
RENAMED = {"PREFIXCACHE_L3_KEY_PREFIX": ("PREFIXCACHE_L3_PREFIX", "--l3-prefix")}


def check_renamed(parser: argparse.ArgumentParser, *new_variables: str) -> None:
    """A usage error when a former name (`RENAMED`) of one of `new_variables` is set."""
    for old, (new, flag) in RENAMED.items():
        if new in map(variable, new_variables) and env_text(old) is not None:
            parser.error(f"{old} was renamed: set {new} ({flag}) instead")


def add_native_flags(parser: argparse.ArgumentParser, *, cpu_kernels: bool) -> None:
    """--cache-native (the cache's C chain hash), with `cpu_kernels` --cpu-native (the compute
    service's C kernels), and --kernel-cache (where both are built): the parameters of
    cache_service.chain_hash.configure and compute_service.kernels.cpu_native.configure."""
    add_flag(parser, "--cache-native", "CACHE_NATIVE", "auto",
             "the page-hash chain in C (built with the system compiler, checked against hashlib "
             "at first use): auto = when it builds, on = refuse to start without it, off = "
             "hashlib", choices=NATIVE_MODES)
    if cpu_kernels:
        add_flag(parser, "--cpu-native", "CPU_NATIVE", "auto",
                 "the fp32 CPU C kernels (projections, paged decode attention, LoRA): auto = "
                 "when they build, on = refuse to start without them, off = oneDNN and PyTorch",
                 choices=NATIVE_MODES)
    add_flag(parser, "--kernel-cache", "KERNEL_CACHE", None,
             "directory of the compiled C kernels; default $XDG_CACHE_HOME/prefixcache/kernels "
             "(~/.cache/prefixcache/kernels)")


def native_settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """--cache-native, --cpu-native and --kernel-cache's variables, for tools that have no such
    flags (benchmarks run as subprocesses with PREFIXCACHE_CPU_NATIVE set); a bad mode is a
    ConfigError naming the variable."""
    return {"cache_native": env_choice("CACHE_NATIVE", "--cache-native", NATIVE_MODES, "auto",
                                       environ),
            "cpu_native": env_choice("CPU_NATIVE", "--cpu-native", NATIVE_MODES, "auto", environ),
            "kernel_cache": env_text("KERNEL_CACHE", environ)}
