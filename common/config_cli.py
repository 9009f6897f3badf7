"""Command-line flags and `LLM_*` environment variables generated from config dataclasses: the one
place that turns a setting's field metadata (help, flag name, choices, unit) into a flag.

Contract
- A dataclass field takes part when its metadata comes from `option(...)` (one setting) or
  `section(...)` (a nested config dataclass, whose own options become flags of the same parser).
  Fields with neither are not settable from outside.
- `Flags(parser, cls, prefix=..., exclude=..., defaults=..., aliases=...)` adds one flag per
  option (booleans get `--X` and `--no-X`), with help naming the default and the variable.
  Every flag has an environment variable: `LLM_` + the flag without dashes, upper-cased, `-` ->
  `_` (`--kv-cache-mb` -> `LLM_KV_CACHE_MB`). Precedence: flag > `LLM_*` variable > an option's
  `env_fallback` (standard variables such as `OTEL_EXPORTER_OTLP_ENDPOINT`) > the caller's
  `defaults` > the dataclass default. Both sources are converted the same way (units such as
  MiB -> bytes, comma lists, "0 means none").
- `Flags.build(ns)` returns the dataclass; `Flags.values(ns)` the same settings as a nested dict
  without constructing it (for a config built elsewhere, e.g. inside a Ray actor, by `construct`);
  `Flags.argv(ns)` the flags given on the command line, for launchers that start `python -m`
  children (which inherit the environment, so variables need no forwarding).
- failure modes: a bad variable -> ValueError naming the variable and its value; a config the
  dataclass refuses (its `__post_init__`) -> its ValueError, plus the variables that set the field
  it names. `parse_or_exit(parser, argv, build)` turns both into argparse usage errors (exit 2).
- state: none; the environment is read when building (`os.environ` unless a mapping is given).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

KEY = "llm_cli"  # the field-metadata key
ENV_PREFIX = "LLM_"
_UNSET = object()
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Unit:
    """The flag is in `name`, the field in `scale` times that (an int)."""

    name: str
    scale: int


MIB = Unit("MiB", 2**20)


@dataclass(frozen=True)
class Option:
    help: str
    flag: str | None = None  # default: --<field-name with dashes>
    aliases: tuple[str, ...] = ()  # further flags for the same setting (old names)
    negative: tuple[str, ...] | None = None  # booleans: flags that set False; None = (--no-<flag>,)
    choices: tuple | None = None
    unit: Unit | None = None
    none_value: Any = _UNSET  # a flag value that means None (e.g. 0 = "no cap")
    parse: Callable[[str], Any] | None = None  # flag text -> field value (instead of the type)
    format: Callable[[Any], str] | None = None  # field value -> flag text (help default)
    env_fallback: Callable[[Mapping[str, str]], Any] | None = None  # field value from other variables
    metavar: str | None = None


@dataclass(frozen=True)
class Section:
    title: str | None = None  # argparse group title of the nested dataclass's flags


def option(help: str, **kwargs) -> dict:
    """Field metadata for one setting: `field(default=..., metadata=option("...", ...))`."""
    return {KEY: Option(help, **kwargs)}


def section(title: str | None = None) -> dict:
    """Field metadata for a nested config dataclass whose options become flags too."""
    return {KEY: Section(title)}


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _prefixed(name: str, prefix: str) -> str:
    """--no-queue with prefix "worker-" -> --no-worker-queue; --port -> --worker-port."""
    name = name.lstrip("-")
    if name.startswith("no-"):
        return "--no-" + prefix + name[3:]
    return "--" + prefix + name


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").upper().replace("-", "_")


def _base_type(hint) -> type:
    """`int | None` -> int; `tuple[str, ...]` -> tuple."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {hint}")
        hint = args[0]
    return typing.get_origin(hint) or hint


def _field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _UNSET


@dataclass
class _Setting:
    """One option as added to a parser."""

    path: tuple[str, ...]  # field names from the top dataclass down
    spec: Option
    kind: type  # the field's base type
    flag: str  # primary flag (prefix applied)
    dest: str
    env: str
    default: Any  # field-level default (caller's or the dataclass's)
    negative: tuple[str, ...] = ()  # booleans: the flags that set False

    @property
    def switch(self) -> bool:
        """A boolean on/off flag pair (a bool field with a `parse` takes a value instead)."""
        return self.kind is bool and self.spec.parse is None

    def cli_type(self) -> Callable[[str], Any]:
        if self.spec.parse is not None or self.kind is str:
            return str
        if self.spec.unit is not None or self.kind is float:
            return float
        if self.kind is int:
            return int
        raise TypeError(f"{'.'.join(self.path)}: no flag type for {self.kind} (give parse=)")

    def to_field(self, value):
        """A flag-level value (already typed by cli_type) -> the field value."""
        spec = self.spec
        if spec.none_value is not _UNSET and value == spec.none_value:
            return None
        if spec.parse is not None:
            return spec.parse(value)
        if spec.unit is not None:
            return int(round(value * spec.unit.scale))
        return value

    def from_env(self, raw: str):
        if self.switch:
            text = raw.strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise ValueError(f"{self.env}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")
        try:
            value = self.cli_type()(raw.strip())
        except ValueError:
            kind = {int: "an integer", float: "a number"}.get(self.cli_type(), "valid")
            raise ValueError(f"{self.env}={raw!r}: not {kind} ({self.flag})") from None
        self.check_choice(value, self.env)
        try:
            return self.to_field(value)
        except ValueError as exc:
            raise ValueError(f"{self.env}={raw!r}: {exc}") from None

    def check_choice(self, value, source: str) -> None:
        if self.spec.choices is not None and value not in self.spec.choices:
            raise ValueError(f"{source}={value!r}: must be one of {', '.join(map(str, self.spec.choices))}")

    def show(self, value) -> str:
        """A field value as flag text (help defaults, argv)."""
        if self.spec.format is not None:
            return self.spec.format(value) or "none"
        if value is None or value == ():
            return "none" if self.spec.none_value is _UNSET else str(self.spec.none_value)
        if self.spec.unit is not None:
            return f"{value / self.spec.unit.scale:g}"
        return str(value)


class Flags:
    """The flags of one config dataclass (and its sections) on a parser; see the module contract."""

    def __init__(
        self,
        parser: argparse.ArgumentParser,
        cls: type,
        *,
        prefix: str = "",
        exclude: Iterable[str] = (),
        defaults: Mapping[str, Any] | None = None,
        aliases: Mapping[str, tuple[str, ...]] | None = None,
        title: str | None = None,
    ):
        """`exclude`, `defaults` and `aliases` are keyed by dotted field path ("telemetry.metrics_port");
        `prefix` goes in front of every flag name ("worker-" -> --worker-drain-grace-s)."""
        self.cls = cls
        self.settings: list[_Setting] = []
        self._exclude = set(exclude)
        self._defaults = dict(defaults or {})
        self._aliases = dict(aliases or {})
        self._prefix = prefix
        self._add(parser, cls, (), parser.add_argument_group(title) if title else parser)

    def _add(self, parser, cls, path, group) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            spec = f.metadata.get(KEY)
            here = (*path, f.name)
            dotted = ".".join(here)
            if spec is None or dotted in self._exclude:
                continue
            if isinstance(spec, Section):
                sub = _base_type(hints[f.name])
                self._add(parser, sub, here, parser.add_argument_group(spec.title) if spec.title else group)
                continue
            flag = _prefixed(spec.flag or f.name.replace("_", "-"), self._prefix)
            default = self._defaults.get(dotted, _field_default(f))
            dest = "cfg_" + self._prefix.replace("-", "_") + "__".join(here)  # unique per prefix
            s = _Setting(here, spec, _base_type(hints[f.name]), flag, dest, env_name(flag), default)
            names = [
                flag,
                *(_prefixed(a, self._prefix) for a in spec.aliases),
                *self._aliases.get(dotted, ()),
            ]
            shown = "" if default is _UNSET or s.switch else f"default: {s.show(default)}; "
            unit = f" ({spec.unit.name})" if spec.unit else ""
            help_text = f"{spec.help}{unit} [{shown}env {s.env}]"
            if s.switch:
                negative = (
                    (spec.flag or f.name.replace("_", "-"),) if spec.negative is None else spec.negative
                )
                s.negative = tuple(
                    _prefixed("no-" + n.lstrip("-") if spec.negative is None else n, self._prefix)
                    for n in negative
                )
                group.add_argument(
                    *names,
                    dest=s.dest,
                    action="store_const",
                    const=True,
                    default=argparse.SUPPRESS,
                    help=f"{help_text} (default: {'on' if default else 'off'})",
                )
                if s.negative:
                    group.add_argument(
                        *s.negative,
                        dest=s.dest,
                        action="store_const",
                        const=False,
                        default=argparse.SUPPRESS,
                        help=f"turn {flag} off",
                    )
            else:
                metavar = spec.metavar or (
                    None if spec.choices else spec.unit.name.upper() if spec.unit else f.name.upper()
                )
                group.add_argument(
                    *names,
                    dest=s.dest,
                    type=s.cli_type(),
                    default=argparse.SUPPRESS,
                    choices=spec.choices,
                    metavar=metavar,
                    help=help_text,
                )
            self.settings.append(s)

    def resolve(
        self, ns: argparse.Namespace, environ: Mapping[str, str] | None = None
    ) -> tuple[dict, dict[tuple[str, ...], str]]:
        """Nested field values that a flag, a variable or a caller default set (dataclass defaults
        are left out), and for each the variable it came from when it came from one."""
        environ = os.environ if environ is None else environ
        given = vars(ns)
        values: dict = {}
        from_env: dict[tuple[str, ...], str] = {}
        for s in self.settings:
            if s.dest in given:
                value = given[s.dest] if s.switch else s.to_field(given[s.dest])
            elif environ.get(s.env, "") != "":
                value = s.from_env(environ[s.env])
                from_env[s.path] = f"{s.env}={environ[s.env]}"
            elif s.spec.env_fallback is not None and s.spec.env_fallback(environ) is not None:
                value = s.spec.env_fallback(environ)
            elif ".".join(s.path) in self._defaults:
                value = s.default
            else:
                continue
            node = values
            for name in s.path[:-1]:
                node = node.setdefault(name, {})
            node[s.path[-1]] = value
        return values, from_env

    def values(self, ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict:
        return self.resolve(ns, environ)[0]

    def build(self, ns: argparse.Namespace, environ: Mapping[str, str] | None = None, **fixed):
        """The dataclass from flags, variables and defaults; `fixed` top-level fields override."""
        values, from_env = self.resolve(ns, environ)
        values.update(fixed)
        try:
            return construct(self.cls, values)
        except ValueError as exc:
            message = str(exc)
            named = [v for path, v in from_env.items() if path[-1] in message]
            if named or from_env:
                message += f" (from the environment: {', '.join(named or from_env.values())})"
            raise ValueError(message) from None

    def argv(
        self, ns: argparse.Namespace, only: Callable[[tuple[str, ...]], bool] | None = None
    ) -> list[str]:
        """The flags of this dataclass that the command line gave, as flags again; `only(path)`
        picks fields by path (("telemetry", "log_format"))."""
        given = vars(ns)
        out: list[str] = []
        for s in self.settings:
            if s.dest not in given or (only is not None and not only(s.path)):
                continue
            value = given[s.dest]
            if s.switch:
                out.append(s.flag if value else s.negative[0])
            else:
                out += [s.flag, str(value)]
        return out

    def env_names(self) -> list[str]:
        return [s.env for s in self.settings]


def construct(cls: type, values: Mapping[str, Any]):
    """`cls(**values)` with nested dicts for `section` fields built into their dataclasses."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            spec = f.metadata.get(KEY)
            if isinstance(spec, Section) and _field_default(f) is _UNSET:
                kwargs[f.name] = construct(_base_type(hints[f.name]), {})
            continue
        value = values[f.name]
        if isinstance(value, Mapping) and isinstance(f.metadata.get(KEY), Section):
            value = construct(_base_type(hints[f.name]), value)
        kwargs[f.name] = value
    unknown = set(values) - set(kwargs) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    return cls(**kwargs)


def new_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser whose usage line stays short (the flags are many; `--help` lists them by group)."""
    return argparse.ArgumentParser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        usage="%(prog)s [flags]  (--help lists them and their LLM_* variables)",
    )


def parse_or_exit(
    parser: argparse.ArgumentParser, argv: list[str] | None, build: Callable[[argparse.Namespace], Any]
):
    """`build(parser.parse_args(argv))`, with a ValueError reported as a usage error (exit 2)."""
    ns = parser.parse_args(argv)
    try:
        return build(ns)
    except ValueError as exc:
        parser.error(str(exc))
