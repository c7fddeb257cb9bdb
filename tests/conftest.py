"""Shared fixtures: the public data folder, and GPU skipping."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.common.paths import data_dir


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return data_dir()


# The test harness sits beside the tests; make it importable as `harness`.
import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
