"""One config source (common/config_cli.py), the helper on a dataclass of its own: flags come from
the config dataclasses' field metadata; flag > LLM_* variable > default; a bad variable is a usage
error naming it. The real entry points and launchers: tests/test_config_launchers.py. No process
is started here."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from common import config_cli
from common.config_cli import MIB, Flags, comma_list, option, section

pytestmark = pytest.mark.usefixtures("clean_llm_env")  # tests/conftest.py: no LLM_*/OTEL_* leaks in


# --- the helper on a dataclass of its own ------------------------------------------------------


@dataclass(frozen=True)
class Inner:
    ratio: float = field(default=0.5, metadata=option("a ratio"))

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio must be in [0, 1], got {self.ratio}")


@dataclass(frozen=True)
class Sample:
    size_bytes: int | None = field(default=None, metadata=option("a size", flag="size-mb", unit=MIB))
    cap: int | None = field(default=10, metadata=option("a cap (0: none)", none_value=0))
    names: tuple[str, ...] = field(default=(), metadata=option("names", parse=comma_list, format=",".join))
    mode: str = field(default="a", metadata=option("a mode", choices=("a", "b")))
    on: bool = field(default=True, metadata=option("a switch", negative=("no-on", "off")))
    inner: Inner = field(default=Inner(), metadata=section("inner"))
    hidden: int = 3  # no metadata: not a flag

    def __post_init__(self) -> None:
        if self.cap is not None and self.cap < 1:
            raise ValueError(f"cap must be >= 1, got {self.cap}")


def sample_parser(**kwargs) -> tuple[argparse.ArgumentParser, Flags]:
    p = argparse.ArgumentParser(prog="sample")
    return p, Flags(p, Sample, **kwargs)


def build(argv, environ=None, **kwargs):
    p, flags = sample_parser(**kwargs)
    return flags.build(p.parse_args(argv), environ or {})


def test_conversions_from_flags():
    s = build(["--size-mb", "1.5", "--cap", "0", "--names", "a, b,", "--mode", "b", "--off", "--ratio", "1"])
    assert s == Sample(size_bytes=3 * 2**19, cap=None, names=("a", "b"), mode="b", on=False, inner=Inner(1.0))
    assert build([]) == Sample()
    assert build(["--no-on"]).on is False and build(["--on"]).on is True


def test_flag_beats_variable_beats_caller_default_beats_dataclass_default():
    env = {"LLM_SIZE_MB": "2", "LLM_CAP": "0", "LLM_NAMES": "x,y", "LLM_ON": "false", "LLM_RATIO": "0.25"}
    from_env = build([], env)
    assert (from_env.size_bytes, from_env.cap, from_env.names, from_env.on, from_env.inner.ratio) == (
        2 * 2**20,
        None,
        ("x", "y"),
        False,
        0.25,
    )
    assert build(["--size-mb", "4", "--on"], env).size_bytes == 4 * 2**20
    assert build(["--on"], env).on is True
    assert build([], {}, defaults={"mode": "b", "inner.ratio": 0.75}) == Sample(mode="b", inner=Inner(0.75))
    assert build([], {"LLM_MODE": "a"}, defaults={"mode": "b"}).mode == "a"


def test_prefix_exclude_and_argv_round_trip():
    p, flags = sample_parser(prefix="w-", exclude=("names", "inner.ratio"))
    assert set(flags.env_names()) == {"LLM_W_SIZE_MB", "LLM_W_CAP", "LLM_W_MODE", "LLM_W_ON"}
    ns = p.parse_args(["--w-size-mb", "3", "--no-w-on", "--w-cap", "0"])
    assert flags.build(ns, {}) == Sample(size_bytes=3 * 2**20, on=False, cap=None)
    again = flags.build(p.parse_args(flags.argv(ns)), {})
    assert again == flags.build(ns, {})
    with pytest.raises(SystemExit):
        p.parse_args(["--names", "a"])  # excluded


@pytest.mark.parametrize(
    "env, message",
    [
        ({"LLM_CAP": "many"}, "LLM_CAP='many': not an integer (--cap)"),
        ({"LLM_SIZE_MB": "big"}, "LLM_SIZE_MB='big': not a number (--size-mb)"),
        ({"LLM_MODE": "c"}, "LLM_MODE='c': must be one of a, b"),
        ({"LLM_ON": "maybe"}, "LLM_ON='maybe': expected one of"),
        ({"LLM_CAP": "-3"}, "cap must be >= 1, got -3 (from the environment: LLM_CAP=-3)"),
        ({"LLM_RATIO": "2"}, "ratio must be in [0, 1], got 2.0 (from the environment: LLM_RATIO=2)"),
    ],
)
def test_a_bad_variable_is_an_error_naming_it(env, message):
    with pytest.raises(ValueError) as failure:
        build([], env)
    assert message in str(failure.value)


def test_construct_builds_sections_from_dicts():
    built = config_cli.construct(Sample, {"inner": {"ratio": 0.1}, "mode": "b"})
    assert built == Sample(mode="b", inner=Inner(0.1))
    with pytest.raises(TypeError, match="no field"):
        config_cli.construct(Sample, {"nope": 1})
