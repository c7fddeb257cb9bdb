"""Shared test set-up: the harness on the import path. Data files come from
`sluice.common.paths.data_file` (the bundle in data/ is enough for every test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The test harness sits beside the tests; make it importable as `harness`.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def predictor_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """SLUICE_CACHE_DIR for the session: encoder exports and embeddings made once, removed at the end."""
    import os

    path = tmp_path_factory.mktemp("sluice-cache")
    old = os.environ.get("SLUICE_CACHE_DIR")
    os.environ["SLUICE_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("SLUICE_CACHE_DIR", None)
    else:
        os.environ["SLUICE_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_predictor_dir(predictor_cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A predictor trained on small slices of the bundled ShareGPT and AlpacaEval subsets (about 30 s)."""
    from predictor_harness import train_tiny_predictor

    return train_tiny_predictor(tmp_path_factory.mktemp("tiny-predictor"))


@pytest.fixture(scope="session")
def tiny_predictor(tiny_predictor_dir: Path):
    from predictor_service.predictor import LengthPredictor

    return LengthPredictor(tiny_predictor_dir, threads=1)
