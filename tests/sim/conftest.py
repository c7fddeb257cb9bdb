"""Fixtures shared by the simulator tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repro() -> ModuleType:
    """benchmarks/repro.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("repro", ROOT / "benchmarks" / "repro.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["repro"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module
