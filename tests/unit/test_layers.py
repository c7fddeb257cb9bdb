"""The layers of docs/ARCHITECTURE.md hold: each package imports only what lies below it.

    sluice_bench/                      the benchmark harness: may import what services/ may; only
                                       benchmarks/ and tests/ import it
    services/                          may import everything but the harness
    sluice_vllm/                       the vLLM plug-in: may import scheduler_service and sluice
    scheduler_service/  worker_service/  predictor_service/  gateway_service/   side by side, never each other
    kvstore/                           accounting (pure Python) and paged (torch)
    sluice/                            the ground floor: contracts and plumbing, no service

Inside scheduler_service, lower layers never import higher ones:

    server.py  inprocess.py            the live service's fronts: gRPC, and the same API called
                                       in-process (the HTTP front of `sluice serve`)
    live/   loadgen/                   the live driver; the client-side load generator (sluice bench)
    sim/                               the simulator driver, SLO profiles, capacity search
    cluster/                           ClusterSpec, build_cluster, Cluster, length sources
    policies/  routers/                the decisions (a policy package may hold its own router)
    workloads/                         traces, arrivals, synthetic workloads
    core/                              request, scheduler, step builder, metrics, SLO judging
    costmodel/                         step-time and memory arithmetic

Read from the source with `ast`, imports inside functions and under TYPE_CHECKING included,
so a late import cannot sneak a back edge in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("scheduler_service", "worker_service", "predictor_service", "gateway_service")

BENCH = ("sluice_bench", "benchmarks", "tests")  # the harness, the scripts and the tests: no product code imports them
# package -> top-level packages it must never import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "sluice": ("services", *SERVICES, "kvstore", "sluice_vllm", "vllm", *BENCH),
    "kvstore": ("services", *SERVICES, *BENCH),
    "scheduler_service": (
        "services", "worker_service", "predictor_service", "gateway_service", "torch", "vllm", "sluice_vllm", *BENCH
    ),
    "worker_service": ("services", "scheduler_service", "predictor_service", "gateway_service", "sluice_vllm", *BENCH),
    "predictor_service": ("services", "scheduler_service", "worker_service", "gateway_service", "sluice_vllm", *BENCH),
    # the HTTP gateway is a client of the scheduler's API: over gRPC like any other, or in-process
    # through a link that services/ hands it (scheduler_service/inprocess.py); it imports neither
    "gateway_service": (
        "services", "scheduler_service", "worker_service", "predictor_service", "sluice_vllm", "torch", "vllm", *BENCH
    ),
    "sluice_vllm": ("services", "worker_service", "predictor_service", "gateway_service", "kvstore", *BENCH),
    "services": BENCH,
    # the harness is imported by benchmarks/ and tests/, never the reverse
    "sluice_bench": ("benchmarks", "tests"),
}
# vLLM is imported only by the modules that adapt to it (the plug-in's and the vLLM engine's) and
# the tests: the project runs without it.
VLLM_ADAPTERS = (
    "sluice_vllm/vllm_compat.py",
    "sluice_vllm/scheduler.py",
    "sluice_vllm/launcher.py",
    "worker_service/vllm_engine.py",
    "sluice_bench/vllm_plugin_harness.py",  # drives vLLM's own scheduler classes, the tests' reference
)


# scheduler_service's layers (a package or a module under it) -> its layers it must never import
_ABOVE_SIM = ("live", "server", "inprocess", "loadgen")
INNER_FORBIDDEN: dict[str, tuple[str, ...]] = {
    "costmodel": ("core", "workloads", "policies", "routers", "cluster", "sim", *_ABOVE_SIM),
    "core": ("workloads", "policies", "routers", "cluster", "sim", *_ABOVE_SIM),
    "workloads": ("policies", "routers", "cluster", "sim", *_ABOVE_SIM),
    "policies": ("workloads", "cluster", "sim", *_ABOVE_SIM),
    "routers": ("policies", "workloads", "cluster", "sim", *_ABOVE_SIM),
    "cluster": ("workloads", "sim", *_ABOVE_SIM),
    "sim": _ABOVE_SIM,
    "live": ("sim", "workloads", "server", "inprocess", "loadgen"),
    "loadgen": ("live", "server", "inprocess"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import; `from package import name` also yields
    `package.name`, since the name may be a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names if alias.name != "*"]
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


def scheduler_layer_files(layer: str, root: Path = ROOT) -> list[Path]:
    base = root / "scheduler_service"
    return sorted((base / layer).rglob("*.py")) if (base / layer).is_dir() else [base / f"{layer}.py"]


def inner_violations(layer: str, root: Path = ROOT) -> list[str]:
    forbidden = tuple(f"scheduler_service.{name}" for name in INNER_FORBIDDEN[layer])
    out: dict[tuple[Path, int, str], str] = {}  # one entry per line and layer reached
    for path in scheduler_layer_files(layer, root):
        for line, module in imported_modules(path):
            for f in forbidden:
                if module == f or module.startswith(f + "."):
                    out.setdefault((path, line, f), f"{path.relative_to(root)}:{line} imports {module}")
    return list(out.values())


@pytest.mark.parametrize("layer", sorted(INNER_FORBIDDEN))
def test_scheduler_layer_imports_nothing_above_it(layer: str) -> None:
    assert scheduler_layer_files(layer)[0].exists(), f"scheduler_service/{layer} does not exist"
    assert inner_violations(layer) == []


def test_every_scheduler_package_has_a_layer() -> None:
    """A new package under scheduler_service must be placed in the order above."""
    base = ROOT / "scheduler_service"
    packages = {p.name for p in base.iterdir() if (p / "__init__.py").exists()}
    modules = {p.stem for p in base.glob("*.py") if p.stem != "__init__"}
    assert packages | modules == set(INNER_FORBIDDEN) | {"server", "inprocess"}


def test_the_checker_sees_an_inner_back_edge(tmp_path: Path) -> None:
    """`from scheduler_service import sim` in cluster/ is a back edge, as is a late import in core/."""
    (tmp_path / "scheduler_service" / "cluster").mkdir(parents=True)
    (tmp_path / "scheduler_service" / "core").mkdir()
    (tmp_path / "scheduler_service" / "cluster" / "a.py").write_text("from scheduler_service import sim\n")
    (tmp_path / "scheduler_service" / "core" / "b.py").write_text(
        "def f():\n    from scheduler_service.policies.common import x\n    from scheduler_service.costmodel import y\n"
    )
    assert inner_violations("cluster", tmp_path) == ["scheduler_service/cluster/a.py:1 imports scheduler_service.sim"]
    found = inner_violations("core", tmp_path)
    assert found == ["scheduler_service/core/b.py:2 imports scheduler_service.policies.common"]


def test_vllm_is_imported_only_by_its_adapters() -> None:
    """Nowhere in the project but the adapter modules of the plug-in and of the vLLM engine (the
    scheduler core, the policies and the plug-in's own policy code stay free of it, so they run
    without vLLM)."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        # tests and benchmarks run vLLM itself as the reference they compare against
        if rel.parts[0] in (".venv", "tests", "benchmarks") or rel.as_posix() in VLLM_ADAPTERS:
            continue
        for line, module in imported_modules(path):
            if module.split(".")[0] == "vllm":
                found.append(f"{rel}:{line} imports {module}")
    assert found == []


def test_the_plugin_core_runs_without_vllm() -> None:
    """sluice_vllm's policies, hints and configuration import no vLLM, even indirectly."""
    import subprocess
    import sys

    code = (
        "import sys, sluice_vllm.policies, sluice_vllm.hints, sluice_vllm.config, sluice_vllm.predictor;"
        "sys.exit(1 if any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_kv_accounting_stays_free_of_torch() -> None:
    modules = [m for _, m in imported_modules(ROOT / "kvstore" / "accounting.py")]
    assert not [m for m in modules if m.split(".")[0] == "torch"]


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    """The check itself: a late import inside a function is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from scheduler_service.core import plan\n    import torch.nn\n")
    found = [m for _, m in imported_modules(module)]
    assert found == ["scheduler_service.core", "scheduler_service.core.plan", "torch.nn"]


def test_the_engine_contract_and_registry_stay_free_of_torch_and_vllm() -> None:
    for name in ("engine_contract.py", "engines.py"):
        modules = [m.split(".")[0] for _, m in imported_modules(ROOT / "worker_service" / name)]
        assert "torch" not in modules and "vllm" not in modules, name


# calls that run or import a file by its path, and sys.path edits: a script reaching into another tree
_PATH_LOADERS = ("spec_from_file_location", "run_path", "SourceFileLoader", "insert", "append")


def cross_references(tree: str, other: str) -> list[str]:
    """Where a file of `tree` (tests or benchmarks) imports `other`, or loads or puts on the import
    path a file or folder named `other` (importlib by file location, runpy, sys.path)."""
    out = []
    for path in sorted((ROOT / tree).rglob("*.py")):
        rel = path.relative_to(ROOT)
        text = path.read_text()
        seen: set[int] = set()  # one entry per import line (`from a import b` also yields a.b)
        for line, module in imported_modules(path):
            if module.split(".")[0] == other and line not in seen:
                seen.add(line)
                out.append(f"{rel}:{line} imports {module}")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in _PATH_LOADERS and f'"{other}"' in (ast.get_source_segment(text, node) or ""):
                out.append(f"{rel}:{node.lineno} loads from {other}/")
    return out


@pytest.mark.parametrize(("tree", "other"), [("tests", "benchmarks"), ("benchmarks", "tests")])
def test_tests_and_benchmarks_share_only_the_harness(tree: str, other: str) -> None:
    """What both use lives in sluice_bench/ (an installed package); neither reaches into the other."""
    assert cross_references(tree, other) == []


def test_the_cross_reference_check_sees_a_file_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(
        'import importlib.util\nspec = importlib.util.spec_from_file_location("r", ROOT / "benchmarks" / "r.py")\n'
        "from benchmarks.repro import main\n"
    )
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert [f.split(" ", 1)[1] for f in cross_references("tests", "benchmarks")] == [
        "imports benchmarks.repro",
        "loads from benchmarks/",
    ]
