"""The Engine contract holds: every registered engine has its members, and the worker's callers
(server, step pipeline, KV transfers, profiler) use an engine through those members only."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from worker_service.engine_contract import Engine, EngineConfig
from worker_service.engines import ENGINES, engine_class, engine_factory

ROOT = Path(__file__).resolve().parents[3]
CALLERS = ("server.py", "step_pipeline.py", "kv_transfer.py", "profiler.py")
CONTRACT = {name for name in dir(Engine) if not name.startswith("_")}


def engine_members_used(path: Path) -> set[str]:
    """Attributes read off anything named `engine`, `_engine` or `*.engine` in a module."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
        if name in ("engine", "_engine"):
            used.add(node.attr)
    return used


@pytest.mark.parametrize("caller", CALLERS)
def test_callers_use_only_the_contracts_members(caller: str) -> None:
    used = engine_members_used(ROOT / "worker_service" / caller)
    assert used, f"{caller}: the check found no engine use at all"
    assert used <= CONTRACT, f"{caller} uses {sorted(used - CONTRACT)} outside the Engine contract"


def test_the_checker_sees_a_member_outside_the_contract(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(runner):\n    runner.engine.model.parameters()\n    return runner.engine.info\n")
    assert engine_members_used(module) == {"model", "info"}


@pytest.mark.parametrize("name", ["torch", "echo"])
def test_registered_engines_satisfy_the_contract(name: str) -> None:
    engine = engine_factory(name)(EngineConfig(model="tiny-llama", load_format="dummy"))
    assert isinstance(engine, Engine)
    engine.init_kv_cache(8, 2)
    assert engine.num_requests == 0 and engine.info.block_size == 16


def test_the_vllm_engine_class_has_every_member_of_the_contract() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("the vllm extra is not installed")
    cls = engine_class("vllm")
    missing = [m for m in CONTRACT if not hasattr(cls, m) and m not in ("book", "cache")]  # set in __init__
    assert missing == []


def test_an_unknown_engine_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="engine: must be one of echo, torch, vllm, none"):
        engine_class("tensorrt")
    assert set(ENGINES) == {"torch", "echo", "vllm"}
