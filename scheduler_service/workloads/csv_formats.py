"""CSV trace readers, each registered in TRACE_FORMATS and recognised by its header.

- `vidur`: the Vidur / Sarathi-Serve length traces (`num_prefill_tokens`, `num_decode_tokens`);
  lengths only, no arrivals.
- `azure`: the Azure LLM inference traces of Splitwise (Patel et al., ISCA 2024):
  `TIMESTAMP` (wall clock) becomes seconds after the first row; `ContextTokens` and
  `GeneratedTokens` are the prompt and output lengths.
- `burstgpt`: BurstGPT (Wang et al., 2024): `Timestamp` in seconds, `Request tokens`,
  `Response tokens`, `Model`, `Log Type`. Rows with 0 response tokens are failed requests
  (the BurstGPT README says so); they are skipped and counted in the metadata.

Each reader yields rows in file order and stops at `num_requests`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from scheduler_service.workloads.base import FileHead, ReadOptions, TraceFormat, TraceRequest, register_format
from scheduler_service.workloads.fileio import iter_csv_rows

_VIDUR_COLUMNS = {"num_prefill_tokens", "num_decode_tokens"}
_AZURE_COLUMNS = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
_BURSTGPT_COLUMNS = {"Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"}


def _has_columns(required: set[str]) -> Callable[[FileHead], bool]:
    def matches(head: FileHead) -> bool:
        return head.kind == "csv" and required <= set(head.columns)

    return matches


def _float(row: dict[str, str | None], column: str, index: int) -> float:
    """A numeric cell; a missing or malformed one names its row (the header is row 1)."""
    raw = row.get(column)
    if raw is None or not raw.strip():
        raise ValueError(f"row {index + 2}: column {column!r} is empty")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"row {index + 2}: column {column!r} is not a number: {raw!r}") from None


def _number(row: dict[str, str | None], column: str, index: int) -> int:
    return int(_float(row, column, index))


def _full(requests: list[TraceRequest], opts: ReadOptions) -> bool:
    return opts.num_requests is not None and len(requests) >= opts.num_requests


def read_vidur(path: Path, opts: ReadOptions) -> tuple[list[TraceRequest], dict[str, Any]]:
    requests: list[TraceRequest] = []
    for i, row in enumerate(iter_csv_rows(path)):
        if _full(requests, opts):
            break
        prompt, output = _number(row, "num_prefill_tokens", i), _number(row, "num_decode_tokens", i)
        requests.append(TraceRequest(str(i), None, prompt, output, source=path.stem))
    return requests, {}


def read_azure(path: Path, opts: ReadOptions) -> tuple[list[TraceRequest], dict[str, Any]]:
    requests: list[TraceRequest] = []
    first: datetime | None = None
    for i, row in enumerate(iter_csv_rows(path)):
        if _full(requests, opts):
            break
        stamp = datetime.fromisoformat((row["TIMESTAMP"] or "").strip())
        first = first or stamp
        arrival = (stamp - first).total_seconds()
        prompt, output = _number(row, "ContextTokens", i), _number(row, "GeneratedTokens", i)
        requests.append(TraceRequest(str(i), arrival, prompt, output, source=path.stem))
    return requests, {"first_timestamp": first.isoformat() if first else None}


def read_burstgpt(path: Path, opts: ReadOptions) -> tuple[list[TraceRequest], dict[str, Any]]:
    requests: list[TraceRequest] = []
    first: float | None = None
    failed = 0
    for i, row in enumerate(iter_csv_rows(path)):
        if _full(requests, opts):
            break
        output = _number(row, "Response tokens", i)
        if output == 0:
            failed += 1
            continue
        stamp = _float(row, "Timestamp", i)
        first = stamp if first is None else first
        tenant = f"{row['Model'].strip()}:{row['Log Type'].strip()}"
        requests.append(
            TraceRequest(
                str(i), stamp - first, _number(row, "Request tokens", i), output, tenant=tenant, source="burstgpt"
            )
        )
    skipped = {"failed_zero_response_tokens": failed}
    return requests, {"skipped": skipped, "first_timestamp_s": first}


register_format(
    TraceFormat(
        "vidur",
        "Vidur/Sarathi length CSV (num_prefill_tokens, num_decode_tokens)",
        _has_columns(_VIDUR_COLUMNS),
        read_vidur,
    )
)
register_format(
    TraceFormat(
        "azure",
        "Azure LLM inference CSV (TIMESTAMP, ContextTokens, GeneratedTokens)",
        _has_columns(_AZURE_COLUMNS),
        read_azure,
    )
)
register_format(
    TraceFormat(
        "burstgpt",
        "BurstGPT CSV (Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type)",
        _has_columns(_BURSTGPT_COLUMNS),
        read_burstgpt,
    )
)
