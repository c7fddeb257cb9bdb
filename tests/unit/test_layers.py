"""The layers of docs/ARCHITECTURE.md hold: each package imports only what lies below it.

    services/                          may import everything
    scheduler_service/  worker_service/  predictor_service/   side by side, never each other
    kvstore/                           accounting (pure Python) and paged (torch)
    sluice/                            the ground floor: contracts and plumbing, no service

Read from the source with `ast`, imports inside functions and under TYPE_CHECKING included,
so a late import cannot sneak a back edge in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("scheduler_service", "worker_service", "predictor_service")

# package -> top-level packages it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "sluice": ("services", *SERVICES, "kvstore"),
    "kvstore": ("services", *SERVICES),
    "scheduler_service": ("services", "worker_service", "predictor_service", "torch"),
    "worker_service": ("services", "scheduler_service", "predictor_service"),
    "predictor_service": ("services", "scheduler_service", "worker_service"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        if "v1" in path.relative_to(ROOT).parts[:2]:
            continue  # generated code
        for line, module in imported_modules(path):
            if module.split(".")[0] in forbidden:
                out.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_above_or_beside_it(package: str) -> None:
    if not (ROOT / package).is_dir():
        pytest.skip(f"{package}/ does not exist")
    assert violations(package, FORBIDDEN[package]) == []


def test_kv_accounting_stays_free_of_torch() -> None:
    modules = [m for _, m in imported_modules(ROOT / "kvstore" / "accounting.py")]
    assert not [m for m in modules if m.split(".")[0] == "torch"]


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The check itself: a late import inside a function is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from scheduler_service.core import plan\n    import torch.nn\n")
    assert [m for _, m in imported_modules(module)] == ["scheduler_service.core", "torch.nn"]


# Modules that adapt to vLLM: the only ones that may import it (the project runs without it).
VLLM_ADAPTERS = {"worker_service/vllm_engine.py"}
PROJECT_PACKAGES = ("sluice", "kvstore", "services", *SERVICES)


def test_only_the_vllm_adapters_import_vllm() -> None:
    found = []
    for package in PROJECT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in VLLM_ADAPTERS:
                continue
            found += [f"{rel}:{line}" for line, m in imported_modules(path) if m.split(".")[0] == "vllm"]
    assert found == []


def test_the_engine_contract_and_registry_stay_free_of_torch_and_vllm() -> None:
    for name in ("engine_contract.py", "engines.py"):
        modules = [m.split(".")[0] for _, m in imported_modules(ROOT / "worker_service" / name)]
        assert "torch" not in modules and "vllm" not in modules, name
