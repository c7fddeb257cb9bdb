"""Configuration once: command-line flags and environment variables generated from the config
dataclasses, parsed by the fields' own types.

    @dataclass
    class WorkerConfig:
        port: int = opt(50061, "port to listen on")

    add_config_arguments(parser, WorkerConfig)   ->  --port N   (help: the text, the default, the env var)
    config_from(WorkerConfig, args, file=path)   ->  WorkerConfig(...)

A value comes from, in rising precedence: the dataclass default, the config file (JSON, or TOML
by its .toml suffix; keys are field names), the environment (`SLUICE_PORT` for `port`), the
command line. Flags default to None in argparse, so only flags given override the others.

Types understood: bool, int, float, str, `X | None` ("none" or "" means None), list[str] (a
comma-separated string, or a repeated flag). `parse_value` is the one parser: the policy options
of `--policy name:key=value` use it too, so `budget=abc` fails naming the option and its type.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, Field, field, fields
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "SLUICE_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

C = TypeVar("C")


def opt(
    default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING, flag: bool = True, cli: str = ""
) -> Any:
    """A dataclass field with its help text; `flag=False` keeps it off the command line, `cli`
    names its flag and variable when they differ from the field's name (`workers` for
    `num_workers`)."""
    metadata = {"help": help, "flag": flag, "cli": cli}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotation of every field (works with `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def _optional_inner(tp: Any) -> Any | None:
    """X for `X | None` (or Optional[X]), else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def parse_value(raw: str, tp: Any, name: str) -> Any:
    """`raw` as a value of type `tp`; ValueError naming `name` when it is not one."""
    inner = _optional_inner(tp)
    if inner is not None:
        return None if raw.strip().lower() in ("", "none", "null") else parse_value(raw, inner, name)
    if tp is bool:
        text = raw.strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError(f"{name}: not a boolean: {raw!r} (use true/false)")
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}: not an integer: {raw!r}") from None
    if tp is float:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}: not a number: {raw!r}") from None
    if tp is str:
        return raw
    if typing.get_origin(tp) is list and typing.get_args(tp) == (str,):
        return [part.strip() for part in raw.split(",") if part.strip()]
    raise TypeError(f"{name}: fields of type {tp!r} cannot be parsed from text")


def cli_name(f: Field) -> str:
    """The name a field goes by on the command line and in the environment."""
    return f.metadata.get("cli") or f.name


def config_from_options(cls: type[C], options: Mapping[str, str], owner: str) -> C:
    """`cls` from `key=value` strings (`--policy name:key=value,...`), each parsed by its field's
    type; an unknown key or a value that does not parse names `owner` and the option."""
    types_ = field_types(cls)
    values: dict[str, Any] = {}
    for key, raw in options.items():
        if key not in types_:
            raise ValueError(f"{owner} has no option {key!r}; known: {', '.join(sorted(types_))}")
        values[key] = parse_value(raw, types_[key], f"{owner}: option {key!r}")
    return cls(**values)


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _flag_fields(cls: type, exclude: Iterable[str]) -> list[Field]:
    skip = set(exclude)
    return [f for f in fields(cls) if f.name not in skip and f.metadata.get("flag", True)]


def _default_text(f: Field) -> str:
    if f.default is not MISSING:
        return repr(f.default) if isinstance(f.default, str) else str(f.default)
    if f.default_factory is not MISSING:
        return str(f.default_factory())
    return "required"


def add_config_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *, exclude: Iterable[str] = ()
) -> None:
    """One flag per field of `cls` (named after it, typed by it, help from its metadata)."""
    types_ = field_types(cls)
    for f in _flag_fields(cls, exclude):
        tp, name = types_[f.name], cli_name(f)
        extra = f"(default: {_default_text(f)}; env {env_name(name)})"
        text = f"{f.metadata.get('help', '')} {extra}".strip()
        flag = flag_name(name)
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        elif typing.get_origin(tp) is list:
            parser.add_argument(flag, dest=f.name, action="append", default=None, help=text + " (repeatable)")
        else:
            parser.add_argument(
                flag, dest=f.name, type=_converter(tp, flag), default=None, metavar=_metavar(tp), help=text
            )


class _GivenNone:
    """What an optional flag given as "none" parses to: argparse leaves flags not given at None,
    so a None value would read as "not given" and the setting would keep its default."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "None"


GIVEN_NONE = _GivenNone()


def _converter(tp: Any, name: str) -> Any:
    def convert(raw: str) -> Any:
        try:
            value = parse_value(raw, tp, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{name}: ")) from None
        return GIVEN_NONE if value is None else value

    return convert


def _metavar(tp: Any) -> str:
    inner = _optional_inner(tp) or tp
    return {int: "N", float: "X", str: "TEXT"}.get(inner, "VALUE")


def read_config_file(path: str | Path) -> dict[str, Any]:
    text = Path(path).read_text()
    raw = tomllib.loads(text) if str(path).endswith(".toml") else json.loads(text)
    return {k.replace("-", "_"): v for k, v in raw.items()}


def config_from(
    cls: type[C],
    args: argparse.Namespace | None = None,
    *,
    file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    exclude: Iterable[str] = (),
    **fixed: Any,
) -> C:
    """`cls` from its defaults < `file` < the environment < the flags given in `args` < `fixed`."""
    environ = os.environ if environ is None else environ
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    types_ = field_types(cls)
    values: dict[str, Any] = {}
    if file:
        values.update(read_config_file(file))
    flagged = _flag_fields(cls, exclude)
    for f in flagged:
        var = env_name(cli_name(f))
        if var in environ:
            values[f.name] = parse_value(environ[var], types_[f.name], var)
    if args is not None:
        given = {f.name: getattr(args, f.name, None) for f in flagged}
        values.update({n: None if v is GIVEN_NONE else _flatten(v) for n, v in given.items() if v is not None})
    values.update(fixed)
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} settings {unknown}; known: {', '.join(sorted(names))}")
    return cls(**values)


def _flatten(value: Any) -> Any:
    """A repeated list flag whose values may each be comma-separated -> one flat list."""
    if isinstance(value, list):
        return [part.strip() for item in value for part in str(item).split(",") if part.strip()]
    return value


def subset(cls: type[C], source: object, **overrides: Any) -> C:
    """An instance of `cls` from the same-named fields of `source` (a config that extends it)."""
    values = {f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)}  # type: ignore[arg-type]
    values.update(overrides)
    return cls(**values)
