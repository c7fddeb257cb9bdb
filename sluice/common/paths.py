"""Where Sluice's data files are: looked up one file at a time, in three folders, in order.

    1. $SLUICE_DATA_DIR                  a larger copy of the data set, in its layout
    2. data/ in the repository           the bundle: small real traces and prompt subsets
                                         (data/README.md says what each file is)
    3. ../shared/data beside the checkout   the team's full data set

    data_file("traces/AzureLLMInferenceTrace_conv.csv")
        -> the first of <folder>/<relpath> or <folder>/<relpath>.gz that exists
        -> open_text(path): text, gunzipped when the file starts with gzip's magic bytes

The bundle stores its files gzipped, hence the `.gz` fallback: callers name a file as the
full data set names it. A file found in no folder is one `DataFileNotFoundError` line that
names the file and where to put it. Outside a checkout (an installed package) the bundle
folder does not exist and only $SLUICE_DATA_DIR and the folder beside count.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO

ENV_VAR = "SLUICE_DATA_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_GZIP_MAGIC = b"\x1f\x8b"


class DataFileNotFoundError(FileNotFoundError):
    """A data file that no data folder holds; the message says where to put it."""


def repo_root() -> Path:
    return _REPO_ROOT


def bundle_dir() -> Path:
    """The small data set shipped in the repository (data/README.md)."""
    return _REPO_ROOT / "data"


def beside_dir() -> Path:
    """The full shared data set in a folder beside the checkout."""
    return _REPO_ROOT.parent / "shared" / "data"


def data_roots() -> list[Path]:
    """The folders searched, in order ($SLUICE_DATA_DIR only when set)."""
    env = os.environ.get(ENV_VAR)
    return ([Path(env).expanduser()] if env else []) + [bundle_dir(), beside_dir()]


def find_data_file(relpath: str | Path, roots: Sequence[Path] | None = None) -> Path | None:
    """The first `<root>/<relpath>` or `<root>/<relpath>.gz` that is a file, else None."""
    rel = Path(relpath)
    for root in data_roots() if roots is None else roots:
        for candidate in (root / rel, root / rel.with_name(rel.name + ".gz")):
            if candidate.is_file():
                return candidate
    return None


def data_file(relpath: str | Path, roots: Sequence[Path] | None = None) -> Path:
    """`find_data_file`, or a one-line DataFileNotFoundError naming the file and where to put it."""
    found = find_data_file(relpath, roots)
    if found is not None:
        return found
    if roots is not None:
        raise DataFileNotFoundError(f"data file {str(relpath)!r} is in none of {', '.join(map(str, roots))}")
    env = os.environ.get(ENV_VAR)
    searched = f"${ENV_VAR} ({env})" if env else f"${ENV_VAR} (not set)"
    raise DataFileNotFoundError(
        f"data file {str(relpath)!r} is in none of {searched}, the bundled {bundle_dir()} or {beside_dir()}: "
        f"put the full data set in a folder and set {ENV_VAR} to it (the file goes at <folder>/{relpath}), "
        f"or place the data set at {beside_dir()}"
    )


def portable_path(path: str | Path) -> str:
    """How a data file is named in results that others read: relative to the data folder that
    holds it (`traces/x.csv`), so no machine's own folders end up in committed JSON; a file
    outside every data folder keeps the path it was given."""
    resolved = Path(path).resolve()
    for root in data_roots():
        try:
            return str(resolved.relative_to(root.resolve()))
        except ValueError:
            continue
    return str(path)


def open_text(path: str | Path) -> IO[str]:
    """A data file as text; gzip is recognised by its magic bytes, not by the file name."""
    with open(path, "rb") as raw:
        is_gzip = raw.read(2) == _GZIP_MAGIC
    if is_gzip:
        return gzip.open(path, "rt", encoding="utf-8", newline="")
    return open(path, encoding="utf-8-sig", newline="")


def cache_dir(topic: str) -> Path:
    """Where derived files that are cheaper to keep than to remake go (created on first use):
    `$SLUICE_CACHE_DIR/<topic>`, else `$XDG_CACHE_HOME/sluice/<topic>`, else
    `~/.cache/sluice/<topic>`. Nothing in it is needed: each file can be made again."""
    root = os.environ.get("SLUICE_CACHE_DIR")
    base = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluice"
    path = base / topic
    path.mkdir(parents=True, exist_ok=True)
    return path
