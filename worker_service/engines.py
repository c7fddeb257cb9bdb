"""The registry of worker engines: `--engine NAME` on `sluice worker`, `sluice serve` and
`sluice profile` picks one.

    torch   ours: our model code and paged KV (worker_service/engine.py)
    echo    no model: checks plans, answers synthetic tokens (worker_service/echo_engine.py); alias none
    vllm    vLLM's worker and model runner executing our plans (worker_service/vllm_engine.py;
            needs the project's `vllm` extra)

Each entry names its class by import path, so choosing `torch` never imports vLLM and a box
without vLLM still lists it (and says how to install it when it is chosen). Adding an engine
is one module that satisfies `Engine` (worker_service/engine_contract.py) and one line here
(a `Registry` of sluice/common/registry.py, like the scheduler's policies and routers).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from typing import Any

from sluice.common.registry import Registry
from worker_service.engine_contract import Engine, EngineConfig

ENGINES: Registry[str] = Registry("engine")  # name -> "module:Class", imported when chosen
ENGINES.add("torch", "worker_service.engine:LLMEngine")
ENGINES.add("echo", "worker_service.echo_engine:EchoEngine")
ENGINES.add("vllm", "worker_service.vllm_engine:VllmEngine")
ENGINES.alias("none", "echo")
INSTALL_HINTS = {"vllm": "install the project's vllm extra (make install, or pip install -e '.[vllm]')"}


def engine_names() -> list[str]:
    return ENGINES.choices()


def engine_class(name: str) -> Callable[..., Engine]:
    """The class registered as `name`; ValueError naming the choices, or how to install it."""
    if name not in ENGINES:
        raise ValueError(f"engine: must be one of {', '.join(engine_names())}, got {name!r}")
    key = ENGINES.canonical(name)
    module, _, attr = ENGINES.get(key).partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        hint = INSTALL_HINTS.get(key, "")
        raise ValueError(f"engine: {name!r} cannot be loaded ({exc}){'; ' + hint if hint else ''}") from exc


def engine_factory(name: str, **options: Any) -> Callable[[EngineConfig], Engine]:
    """A function building engine `name` from an EngineConfig, with the engine's own options
    (the echo engine's step_time_s and async_device)."""
    return partial(engine_class(name), **options)
