"""The plug-in's configuration, read from the environment of vLLM's engine process (the one
place it comes from; `vllm serve` passes its environment on to the engine core it starts).

    SLUICE_VLLM_POLICY     POLICY[:key=value,key=value...]   (default: fcfs)
                           fcfs | priority | slo_class | sarathi | alise | fastserve | accelgen
                           e.g. "alise:aging_s=2,num_queues=6", "sarathi:tbt_slo_ms=50"
    SLUICE_VLLM_PREDICTOR  HOST:PORT of Sluice's length predictor service; unset: no predictor
                           (a request without a predicted length counts as max_tokens)
    SLUICE_VLLM_PREDICTOR_TIMEOUT_MS   the predictor's deadline (default 200, the scheduler's)
    SLUICE_VLLM_PREDICTOR_MODEL        the served model's name as the predictor knows it
    SLUICE_VLLM_TRACE      a file the plug-in appends JSON lines to: each request's hints as
                           they arrived, and the counters every `trace_every_s` and at exit
    SLUICE_VLLM_STEP_LOG   a file the plug-in appends one JSON line per step to: when the step
                           was scheduled, its prefill chunks and decodes, the requests left
                           after it (what a step-time profile of the served engine is fitted on)

Each policy's keys are the fields of its options class in `sluice_vllm.policies`; an unknown
key or a bad value is an error that names it, raised when vLLM builds the scheduler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

ENV_POLICY = "SLUICE_VLLM_POLICY"
ENV_PREDICTOR = "SLUICE_VLLM_PREDICTOR"
ENV_PREDICTOR_TIMEOUT_MS = "SLUICE_VLLM_PREDICTOR_TIMEOUT_MS"
ENV_PREDICTOR_MODEL = "SLUICE_VLLM_PREDICTOR_MODEL"
ENV_TRACE = "SLUICE_VLLM_TRACE"
ENV_STEP_LOG = "SLUICE_VLLM_STEP_LOG"
DEFAULT_PREDICTOR_TIMEOUT_MS = 200.0  # the live scheduler's default (scheduler_service/live/config.py)


class PluginConfigError(ValueError):
    """A configuration value the plug-in cannot use; the message names the variable and key."""


@dataclass(frozen=True)
class PluginConfig:
    policy: str = "fcfs"
    options: dict[str, str] = field(default_factory=dict)
    predictor: str | None = None
    predictor_timeout_s: float = DEFAULT_PREDICTOR_TIMEOUT_MS / 1e3
    predictor_model: str = ""
    trace_path: str | None = None
    step_log_path: str | None = None


def parse_policy(spec: str) -> tuple[str, dict[str, str]]:
    """ "alise:aging_s=2,num_queues=6" -> ("alise", {"aging_s": "2", "num_queues": "6"})."""
    name, _, rest = spec.strip().partition(":")
    options: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise PluginConfigError(f"{ENV_POLICY}: {item!r} is not key=value (in {spec!r})")
        options[key.strip()] = value.strip()
    return name.strip().lower() or "fcfs", options


def from_env(env: dict[str, str] | None = None) -> PluginConfig:
    env = dict(os.environ if env is None else env)
    policy, options = parse_policy(env.get(ENV_POLICY, "fcfs"))
    timeout_ms = env.get(ENV_PREDICTOR_TIMEOUT_MS)
    try:
        timeout_s = float(timeout_ms) / 1e3 if timeout_ms else DEFAULT_PREDICTOR_TIMEOUT_MS / 1e3
    except ValueError:
        raise PluginConfigError(f"{ENV_PREDICTOR_TIMEOUT_MS}: {timeout_ms!r} is not a number of milliseconds") from None
    if timeout_s <= 0:
        raise PluginConfigError(f"{ENV_PREDICTOR_TIMEOUT_MS}: must be positive, got {timeout_ms!r}")
    return PluginConfig(
        policy=policy,
        options=options,
        predictor=env.get(ENV_PREDICTOR) or None,
        predictor_timeout_s=timeout_s,
        predictor_model=env.get(ENV_PREDICTOR_MODEL, ""),
        trace_path=env.get(ENV_TRACE) or None,
        step_log_path=env.get(ENV_STEP_LOG) or None,
    )


def build_options(cls: type, options: dict[str, str], policy: str) -> Any:
    """An options dataclass from string values, each converted to its field's type."""
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in options.items():
        if key not in known:
            names = ", ".join(sorted(known)) or "none"
            raise PluginConfigError(f"{ENV_POLICY}: policy {policy!r} has no option {key!r}; its options: {names}")
        values[key] = _convert(known[key].type, raw, f"{ENV_POLICY}: {policy}.{key}")
    return cls(**values)


def _convert(kind: Any, raw: str, where: str) -> Any:
    """`kind` is the field's annotation as a string (the module uses postponed annotations)."""
    kind = str(kind).replace(" ", "")
    optional = kind.endswith("|None")
    base = kind.removesuffix("|None")
    if optional and raw.lower() in ("", "none"):
        return None
    try:
        if base == "bool":
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if base == "int":
            return int(raw)
        if base == "float":
            return float(raw)
    except ValueError:
        raise PluginConfigError(f"{where}: {raw!r} is not a valid {base}") from None
    return raw
