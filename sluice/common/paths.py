"""Where the shared public data lives: `$SLUICE_DATA_DIR`, else `shared/data` beside or
inside the checkout (the layout of a clone with the team's shared folder next to it)."""

from __future__ import annotations

import os
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[2]


def repo_root() -> Path:
    return _REPO_ROOT


def data_dir() -> Path:
    env = os.environ.get("SLUICE_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates += [_REPO_ROOT.parent / "shared" / "data", _REPO_ROOT / "shared" / "data"]
    for path in candidates:
        if path.is_dir():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(f"shared data folder not found (tried {tried}); set SLUICE_DATA_DIR")
