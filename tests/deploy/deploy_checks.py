"""Helpers of the deploy checks: finding the validators (installed with the dev extra), and the
environment contract: every flag --foo-bar of a `sluice` command is also SLUICE_FOO_BAR."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# Variables the services read from the environment directly, not through a flag.
ENV_ONLY = {"SLUICE_CACHE_DIR", "SLUICE_DATA_DIR"}
# Flags the deploy files set (as variables) that the commands do not have yet. The test fails
# once a command gains one of them: then delete it here. Each is in the deploy report.
# Flags a manifest may already set before the command has them; none are left.
PENDING_FLAGS: dict[tuple[str, ...], set[str]] = {}
# The `sluice` command each image runs (its ENTRYPOINT), by image name without the variant.
IMAGE_COMMANDS = {
    "scheduler": ("scheduler",),
    "worker": ("worker",),
    "predictor": ("predictor", "serve"),
    "gateway": ("gateway",),
}


def probe_command(check: str) -> list[str]:
    """The image's health check command: a gRPC service's health (its name, "" for liveness),
    or for the HTTP gateway a path (starting with /) asked over HTTP."""
    flag = ["--http", check] if check.startswith("/") else ["--service", check]
    return ["python", "-m", "sluice.common.healthcheck", *flag]


def tool(name: str) -> str | None:
    """A command-line tool on PATH or beside this Python (the venv's bin/)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.is_file() else None)


def need_tool(name: str, package: str) -> str:
    path = tool(name)
    if path is None:
        pytest.skip(f"{name} is not installed (pip install {package}, in the dev extra)")
    return path


@functools.cache
def command_flags(command: tuple[str, ...]) -> frozenset[str] | None:
    """The long flags of `sluice COMMAND --help`, or None when this checkout has no such command."""
    code = "import sys; from services.cli import main; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", code, *command, "--help"], capture_output=True, text=True)
    if result.returncode != 0:
        return None
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", result.stdout)) - {"--help"}


def flag_of(variable: str) -> str:
    return "--" + variable.removeprefix("SLUICE_").lower().replace("_", "-")


def contract_problems(command: tuple[str, ...], variables: set[str]) -> list[str] | None:
    """What breaks `SLUICE_FOO_BAR` <-> `--foo-bar` for these variables of one service; None
    when this checkout has no such command."""
    flags = command_flags(command)
    if flags is None:
        return None
    pending = PENDING_FLAGS.get(command, set())
    wanted = {flag_of(v) for v in variables if v.startswith("SLUICE_") and v not in ENV_ONLY}
    problems = [f"sluice {' '.join(command)} has no {f} (set as a variable)" for f in sorted(wanted - flags - pending)]
    problems += [
        f"sluice {' '.join(command)} now has {f}: delete it from PENDING_FLAGS" for f in sorted(pending & flags)
    ]
    return problems


def check_contract(services: list[tuple[tuple[str, ...], set[str]]]) -> None:
    """Fail on any contract problem; then skip, naming them, if some commands are not here."""
    problems, absent = [], set()
    for command, variables in services:
        found = contract_problems(command, variables)
        if found is None:
            absent.add("sluice " + " ".join(command))
        else:
            problems += found
    assert not problems, problems
    if absent:
        pytest.skip(f"not in this checkout, so not checked: {', '.join(sorted(absent))}")
