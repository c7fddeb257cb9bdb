"""Fixtures shared by the simulator tests."""

from __future__ import annotations

from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def repro() -> ModuleType:
    """The paper reproductions (sluice_bench.repro: claims, runs, tables and the command)."""
    import sluice_bench.repro

    return sluice_bench.repro
