"""The installed package's version, as every service reports it (Info, GetServerInfo)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def sluice_version() -> str:
    try:
        return version("sluice")
    except PackageNotFoundError:
        return "0+unknown"
