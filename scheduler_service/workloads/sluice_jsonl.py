"""Sluice's own trace format: JSON Lines, one request per line, SLOs in milliseconds (the
units of the client API):

    {"request_id": "7", "arrival_s": 0.25, "prompt_tokens": 812, "output_tokens": 64,
     "prompt": "...", "slo": {"ttft_ms": 500, "tbt_ms": 187.5, "jct_ms": null, "class": "online"},
     "priority": 0, "tenant": "team-a"}

Only `prompt_tokens` and `output_tokens` are required. `write_sluice_jsonl` writes any
workload in this format (after arrivals and SLOs are attached), so a generated or rescaled
workload can be replayed exactly by the simulator and by `sluice bench`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scheduler_service.core.slo import SLOClass, SLOSpec
from scheduler_service.workloads.base import (
    FileHead,
    ReadOptions,
    TraceFormat,
    TraceRequest,
    Workload,
    register_format,
)
from scheduler_service.workloads.fileio import iter_jsonl


def _ms_to_s(value: Any) -> float | None:
    return None if value is None else float(value) / 1000.0


def _s_to_ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def slo_from_dict(data: dict[str, Any] | None) -> SLOSpec | None:
    if not data:
        return None
    slo_class = data.get("class")
    return SLOSpec(
        ttft_s=_ms_to_s(data.get("ttft_ms")),
        tbt_s=_ms_to_s(data.get("tbt_ms")),
        jct_s=_ms_to_s(data.get("jct_ms")),
        slo_class=SLOClass(slo_class) if slo_class else None,
    )


def slo_to_dict(slo: SLOSpec) -> dict[str, Any]:
    return {
        "ttft_ms": _s_to_ms(slo.ttft_s),
        "tbt_ms": _s_to_ms(slo.tbt_s),
        "jct_ms": _s_to_ms(slo.jct_s),
        "class": slo.slo_class.value if slo.slo_class else None,
    }


def request_from_dict(record: dict[str, Any], index: int) -> TraceRequest:
    arrival = record.get("arrival_s")
    token_ids = record.get("prompt_token_ids")
    return TraceRequest(
        request_id=str(record.get("request_id", index)),
        arrival_s=None if arrival is None else float(arrival),
        prompt_tokens=int(record["prompt_tokens"]),
        output_tokens=int(record["output_tokens"]),
        prompt_text=record.get("prompt"),
        prompt_token_ids=None if token_ids is None else tuple(int(t) for t in token_ids),
        slo=slo_from_dict(record.get("slo")),
        priority=int(record.get("priority", 0)),
        tenant=str(record.get("tenant", "")),
        source=str(record.get("source", "")),
        prefix_hash_ids=tuple(int(h) for h in record.get("prefix_hash_ids", ())),
    )


def request_to_dict(request: TraceRequest) -> dict[str, Any]:
    record: dict[str, Any] = {
        "request_id": request.request_id,
        "arrival_s": request.arrival_s,
        "prompt_tokens": request.prompt_tokens,
        "output_tokens": request.output_tokens,
        "priority": request.priority,
        "tenant": request.tenant,
    }
    optional = {
        "prompt": request.prompt_text,
        "prompt_token_ids": list(request.prompt_token_ids) if request.prompt_token_ids is not None else None,
        "slo": slo_to_dict(request.slo) if request.slo is not None else None,
        "source": request.source or None,
        "prefix_hash_ids": list(request.prefix_hash_ids) or None,
    }
    record.update({k: v for k, v in optional.items() if v is not None})
    return record


def read_sluice(path: Path, opts: ReadOptions) -> tuple[list[TraceRequest], dict[str, Any]]:
    requests: list[TraceRequest] = []
    for i, record in enumerate(iter_jsonl(path)):
        if opts.num_requests is not None and len(requests) >= opts.num_requests:
            break
        requests.append(request_from_dict(record, i))
    return requests, {}


def write_sluice_jsonl(workload: Workload, path: str | Path) -> Path:
    out = Path(path)
    with open(out, "w", encoding="utf-8") as stream:
        for request in workload.requests:
            stream.write(json.dumps(request_to_dict(request), ensure_ascii=False) + "\n")
    return out


def _is_sluice(head: FileHead) -> bool:
    record = head.first_record
    return head.kind == "jsonl" and record is not None and {"prompt_tokens", "output_tokens"} <= record.keys()


register_format(
    TraceFormat(
        "sluice",
        "Sluice JSONL (request_id, arrival_s, prompt_tokens, output_tokens, slo, ...)",
        _is_sluice,
        read_sluice,
    )
)
