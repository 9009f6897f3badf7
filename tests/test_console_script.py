"""`llm-serve` (deploy/cli.py, the pyproject console script): each subcommand dispatches to the
existing `python -m` entry point with the rest of the command line; nothing in the Makefile needs
the package installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib

import pytest

from deploy import cli
from tests.procs import REPO


def test_pyproject_declares_the_script_and_the_packages():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"] == {"llm-serve": "deploy.cli:main"}
    assert project["build-system"]["build-backend"] == "setuptools.build_meta"
    included = project["tool"]["setuptools"]["packages"]["find"]["include"]
    for command, (module, _) in cli.COMMANDS.items():
        assert f"{module.split('.')[0]}*" in included, command


@pytest.mark.parametrize(
    "argv, module, rest",
    [
        (["serve", "--workers", "2"], "deploy.local", ["--workers", "2"]),
        (["router", "--port", "0"], "router", ["--port", "0"]),
        (["worker", "--dtype", "float32"], "worker", ["--dtype", "float32"]),
        (["generate", "--chat", "hi"], "devtools.client", ["--chat", "hi"]),
        (["loadtest", "--duration-s", "5"], "loadtest", ["--duration-s", "5"]),
        (["launch", "--stop"], "deploy.ray_launch", ["--stop"]),
        (["bench", "grpc_overhead", "--x"], "benchmarks.grpc_overhead", ["--x"]),
    ],
)
def test_subcommands_map_to_the_entry_points(argv, module, rest):
    resolved, args, prog = cli.resolve(argv)
    assert (resolved, args) == (module, rest) and prog.startswith("llm-serve ")
    assert importlib.util.find_spec(resolved) is not None


@pytest.mark.parametrize("argv", [[], ["nope"], ["bench"], ["bench", "nope"]])
def test_unknown_subcommands_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.resolve(argv)
    assert exit_.value.code == 2
    assert "usage: llm-serve" in capsys.readouterr().err


def test_the_rest_of_the_command_line_reaches_the_module():
    """Through a real process: the worker's own help and its own usage error."""
    helped = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "worker", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert helped.returncode == 0 and "--kv-cache-mb" in helped.stdout and "LLM_KV_CACHE_MB" in helped.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "router", "--fair-queue", "lifo"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "invalid choice: 'lifo'" in bad.stderr


def test_make_targets_do_not_need_the_package_installed():
    recipes = [line for line in (REPO / "Makefile").read_text().splitlines() if line.startswith("\t")]
    assert not [r for r in recipes if "llm-serve" in r]
    assert any("$(PY) -m deploy.local" in r for r in recipes)
