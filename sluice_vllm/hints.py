"""Per-request hints: what a client tells the plug-in about one request.

They travel on the request itself, because the scheduler sees vLLM's internal request id
(the client's id with a suffix), so a side table keyed by the client's id would never match:

    OpenAI API:  {"prompt": ..., "priority": 3,
                  "vllm_xargs": {"predicted_tokens": 120, "tbt_ms": 50, "slo_class": "online"}}
    Python API:  SamplingParams(..., extra_args={"predicted_tokens": 120, ...}), priority=3

    predicted_tokens  predicted output length (ALISE's order; AccelGen's offline budget)
    ttft_ms, tbt_ms   per-request SLOs (AccelGen's urgency and budget, slo_class's budget)
    jct_ms            completion-time SLO (an offline request has only this one)
    slo_class         "online" or "offline" (default: offline when only jct_ms is given)

A bad hint never fails the request: it is dropped, logged with the field named, and counted
(`bad_hints` in the trace), and the request is scheduled as if it had not been given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from scheduler_service.policies.decisions import is_offline_slo

HINT_KEYS = ("predicted_tokens", "ttft_ms", "tbt_ms", "jct_ms", "slo_class")


@dataclass(slots=True)
class Hints:
    predicted_tokens: int | None = None
    ttft_s: float | None = None
    tbt_s: float | None = None
    jct_s: float | None = None
    offline: bool = False

    @property
    def given(self) -> list[str]:
        out = []
        if self.predicted_tokens is not None:
            out.append("predicted_tokens")
        out += [
            k for k, v in (("ttft_ms", self.ttft_s), ("tbt_ms", self.tbt_s), ("jct_ms", self.jct_s)) if v is not None
        ]
        if self.offline:
            out.append("slo_class")
        return out


def parse_hints(extra_args: Mapping[str, Any] | None) -> tuple[Hints, list[str]]:
    """(hints, problems): each problem names the field and why it was dropped."""
    hints = Hints()
    problems: list[str] = []
    if not extra_args:
        return hints, problems
    raw = extra_args.get("predicted_tokens")
    if raw is not None:
        value = _number(raw)
        if value is None or value < 1 or value != int(value):
            problems.append(f"predicted_tokens: {raw!r} is not a positive integer")
        else:
            hints.predicted_tokens = int(value)
    for key in ("ttft_ms", "tbt_ms", "jct_ms"):
        raw = extra_args.get(key)
        if raw is None:
            continue
        value = _number(raw)
        if value is None or value <= 0:
            problems.append(f"{key}: {raw!r} is not a positive number of milliseconds")
            continue
        setattr(hints, key.replace("_ms", "_s"), value / 1e3)
    raw = extra_args.get("slo_class")
    if raw is None:
        hints.offline = is_offline_slo(hints.ttft_s, hints.tbt_s, hints.jct_s)
    elif str(raw).lower() in ("online", "offline"):
        hints.offline = str(raw).lower() == "offline"
    else:
        problems.append(f"slo_class: {raw!r} is neither 'online' nor 'offline'")
    return hints, problems


def _number(raw: Any) -> float | None:
    if isinstance(raw, bool):
        return None
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None
