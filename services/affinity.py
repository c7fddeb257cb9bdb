"""CPU sets for the processes `sluice serve` starts: "0", "0-3", "0,2-3" -> the CPUs a child is
pinned to (Linux sched_setaffinity), so the length predictor can have cores the workers never
use, as it has when it runs as its own container."""

from __future__ import annotations

import os


def can_pin() -> bool:
    """Whether this OS can pin a process to CPUs (Linux can; macOS has no sched_setaffinity)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def parse_cpus(spec: str | int | None, name: str) -> frozenset[int] | None:
    """The CPUs of a list like "0,2-3"; None for no pinning (None or blank). ValueError naming
    `name` for a malformed list, a CPU this process may not use, or an OS that cannot pin (a set
    option is never ignored: a measurement would silently run unpinned)."""
    # NOTE: str() because a JSON or TOML config file may give a single CPU as a number
    text = "" if spec is None else str(spec).strip()
    if not text:
        return None
    if not can_pin():
        raise ValueError(f"{name}: this OS cannot pin a process to CPUs (no os.sched_setaffinity)")
    cpus: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(f"{name}: not a CPU list like 0,2-3: {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"{name}: not a CPU range: {part.strip()!r} in {text!r}")
        cpus.update(range(first, last + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ValueError(
            f"{name}: CPU {format_cpus(cpus - allowed)} not available to this process "
            f"(it may use {format_cpus(allowed)})"
        )
    return frozenset(cpus)


def format_cpus(cpus: set[int] | frozenset[int]) -> str:
    """The shortest list that parse_cpus reads back: {0, 1, 2, 5} -> "0-2,5"."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and cpu == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)
