"""Every live-scheduler option that can be checked without the workers, checked at once.

`sluice serve` calls `check_live_config` before it starts a single child process (a bad
policy option used to surface 10 s later, after the workers had loaded), `LiveScheduler`
again when it is built. A ValueError names the option and what is wrong with it.
"""

from __future__ import annotations

import math
from pathlib import Path

from scheduler_service.cluster import build  # noqa: F401  (registers the policies and routers)
from scheduler_service.core.policy import POLICIES, parse_policy_spec
from scheduler_service.live.config import LiveConfig
from scheduler_service.live.transfers import check_transfer_config
from scheduler_service.routers import build_router

_POSITIVE = (
    "predictor_timeout_ms",
    "step_timeout_s",
    "connect_timeout_s",
    "probe_interval_s",
    "reconnect_min_s",
    "reconnect_max_s",
    "transfer_timeout_s",
)
_AT_LEAST_ONE = ("default_max_tokens",)


def check_live_config(cfg: LiveConfig) -> None:
    cfg.check()  # the deployment's settings, checked as the simulator checks them
    for name in _AT_LEAST_ONE:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}: must be >= 1, got {getattr(cfg, name)!r}")
    for name in _POSITIVE:
        value = getattr(cfg, name)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
    for name in ("max_prompt_bytes", "num_gpu_blocks"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ValueError(f"{name}: must be >= 1 (or none), got {value!r}")
    if cfg.retry_after_s < 0:
        raise ValueError(f"retry_after_s: must be >= 0, got {cfg.retry_after_s!r}")
    if cfg.admission not in ("slo", "off"):
        raise ValueError(f"admission: must be slo or off, got {cfg.admission!r}")
    if not 0 < cfg.admission_headroom <= 1:
        raise ValueError(f"admission_headroom: must be in (0, 1], got {cfg.admission_headroom!r}")
    if cfg.profile is not None and not Path(cfg.profile).is_file():
        raise ValueError(f"profile: no such file {cfg.profile!r}")
    if cfg.tokenizer is not None and not Path(cfg.tokenizer).is_file():
        raise ValueError(f"tokenizer: no such file {cfg.tokenizer!r}")
    _check_policy(cfg.policy)
    try:
        build_router(cfg.router)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"router: {cfg.router!r}: {_message(exc)}") from None
    check_transfer_config(cfg)


def _check_policy(spec: str) -> None:
    try:
        name, options = parse_policy_spec(spec)
        POLICIES.get(name).config_cls.from_options(options)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"policy: {spec!r}: {_message(exc)}") from None


def _message(exc: BaseException) -> str:
    return exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
