"""`load_trace`: a short name, a synthetic generator's name or a path in, a `Workload` out.

Data flow: name -> file found by `data_file()` (SHORT_NAMES; $SLUICE_DATA_DIR, the bundled
data/, the shared folder beside the checkout) or a path -> format (given, or
detected from the file's header / first record by each TRACE_FORMATS entry's `matches`) ->
the format's reader (streams, stops at `num_requests`) -> `Workload` with provenance
metadata -> optional arrival process (arrivals.py). Synthetic names (synthetic.py) skip the
file steps. Unknown names are FileNotFoundError, unrecognised files ValueError; both say
which file and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scheduler_service.workloads import (  # noqa: F401  (registration)
    csv_formats,
    json_formats,
    multiturn,
    sluice_jsonl,
)
from scheduler_service.workloads.arrivals import apply_arrivals
from scheduler_service.workloads.base import (
    TRACE_FORMATS,
    FileHead,
    ReadOptions,
    TraceFormat,
    TraceRequest,
    Workload,
)
from scheduler_service.workloads.fileio import read_head
from scheduler_service.workloads.synthetic import SYNTHETIC_WORKLOADS
from scheduler_service.workloads.tokens import TokenCounter, make_token_counter
from sluice.common.paths import DataFileNotFoundError, data_file, portable_path

SHORT_NAMES: dict[str, str] = {
    "azure-conv": "traces/AzureLLMInferenceTrace_conv.csv",
    "azure-code": "traces/AzureLLMInferenceTrace_code.csv",
    "arxiv": "traces/vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "sharegpt": "traces/sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "mooncake": "traces/mooncake_synthetic_trace.jsonl",
    "sharegpt-conversations": "prompts/sharegpt_v3_conversations.jsonl.gz",
    "sharegpt-multiturn": "prompts/sharegpt_v3_conversations.jsonl.gz",
    "alpaca-eval": "prompts/alpaca_eval_outputs_32models.jsonl.gz",
    "codealpaca": "prompts/codealpaca_new_codealpaca.json",
    "codealpaca-2k": "prompts/codealpaca_code_alpaca_2k.json",
    # Subsets bundled in data/ (prefixes of the two files above them, data/README.md).
    "sharegpt-conversations-2k": "prompts/sharegpt_v3_conversations_2k_first_turns.jsonl.gz",
    "sharegpt-multiturn-300": "prompts/sharegpt_v3_conversations_300_whole.jsonl.gz",
    "alpaca-eval-2models": "prompts/alpaca_eval_outputs_2models.jsonl.gz",
}
# Short names read with a format of their own rather than the one detected from the file.
SHORT_NAME_FORMATS: dict[str, str] = {
    "sharegpt-multiturn": "sharegpt-multiturn",
    "sharegpt-multiturn-300": "sharegpt-multiturn",
}
DEFAULT_SYNTHETIC_REQUESTS = 10_000
# NOTE: sluice is checked first: its records may carry any other format's keys as extras.
_DETECTION_ORDER = ("sluice", "mooncake", "sharegpt", "codealpaca", "alpaca-eval", "azure", "burstgpt", "vidur")


def known_names() -> list[str]:
    return sorted(SHORT_NAMES) + SYNTHETIC_WORKLOADS.names()


def resolve_path(name_or_path: str | Path) -> Path:
    key = str(name_or_path)
    if key in SHORT_NAMES:
        try:
            return data_file(SHORT_NAMES[key])
        except DataFileNotFoundError as exc:
            raise DataFileNotFoundError(f"trace {key!r}: {exc}") from None
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"no trace file {str(path)!r} and no trace by that name; known names: {', '.join(known_names())}"
        )
    return path


def detect_format(path: str | Path) -> TraceFormat:
    head = _read_head(Path(path))
    names = [n for n in _DETECTION_ORDER if n in TRACE_FORMATS] + [
        n for n in TRACE_FORMATS if n not in _DETECTION_ORDER
    ]
    for name in names:
        fmt = TRACE_FORMATS.get(name)
        if fmt.matches(head):
            return fmt
    raise ValueError(f"{path}: unrecognised trace format ({_describe(head)}); expected one of: {_expected()}")


def _read_head(path: Path) -> FileHead:
    try:
        return read_head(path)
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise ValueError(
            f"{path}: cannot read it as CSV, JSON or JSON Lines ({exc}); expected one of: {_expected()}"
        ) from exc


def _describe(head: FileHead) -> str:
    if head.kind == "csv":
        return f"CSV header {list(head.columns)}"
    keys = sorted(head.first_record) if head.first_record else []
    return f"{head.kind} whose first record has keys {keys}"


def _expected() -> str:
    return "; ".join(TRACE_FORMATS.get(n).description for n in TRACE_FORMATS)


def check_requests(requests: list[TraceRequest]) -> None:
    """Lengths >= 1 and arrivals that start at >= 0 and never go back in time; the first
    offending record is named (records count from 1)."""
    last = 0.0
    for i, r in enumerate(requests, start=1):
        if r.prompt_tokens < 1:
            raise ValueError(f"record {i} (request {r.request_id!r}): prompt length {r.prompt_tokens} must be >= 1")
        if r.output_tokens < 1:
            raise ValueError(f"record {i} (request {r.request_id!r}): output length {r.output_tokens} must be >= 1")
        if r.arrival_s is None:
            continue
        if r.arrival_s < last:
            raise ValueError(
                f"record {i} (request {r.request_id!r}): timestamp {r.arrival_s:g} s comes before the previous "
                f"record's {last:g} s (timestamps must be >= 0 and sorted)"
            )
        last = r.arrival_s


def read_trace_file(
    path: str | Path,
    *,
    num_requests: int | None = None,
    fmt: str | None = None,
    token_counter: TokenCounter | None = None,
    name: str | None = None,
) -> Workload:
    path = Path(path)
    if fmt is not None and fmt not in TRACE_FORMATS:
        raise ValueError(f"{path}: unknown trace format {fmt!r}; known: {', '.join(TRACE_FORMATS.names())}")
    trace_format = TRACE_FORMATS.get(fmt) if fmt is not None else detect_format(path)
    counter = token_counter or make_token_counter()
    try:
        requests, extra = trace_format.read(path, ReadOptions(num_requests, counter))
        check_requests(requests)
    except (KeyError, ValueError, TypeError) as exc:
        detail = str(exc) if isinstance(exc, ValueError) else repr(exc)
        raise ValueError(f"{path}: not a valid {trace_format.description} file: {detail}") from None
    metadata: dict[str, Any] = {
        "path": portable_path(path),
        "format": trace_format.name,
        "num_requests_limit": num_requests,
        "token_counter": getattr(counter, "name", repr(counter)),
        "history": [f"load {path.name} as {trace_format.name}"],
        **extra,
    }
    return Workload(name or path.stem, requests, metadata)


def load_trace(
    name_or_path: str | Path,
    *,
    num_requests: int | None = None,
    seed: int = 0,
    fmt: str | None = None,
    token_counter: TokenCounter | None = None,
    tokenizer_path: str | Path | None = None,
    rate: float | None = None,
    arrival: str = "auto",
    cv: float = 1.0,
) -> Workload:
    """Load a trace, prompt set or synthetic workload; with `rate` (or a named `arrival`
    process) also give it arrival times. `seed` drives synthetic lengths and arrivals."""
    if num_requests is not None and num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    key = str(name_or_path)
    if key in SYNTHETIC_WORKLOADS and key not in SHORT_NAMES:
        workload = SYNTHETIC_WORKLOADS.get(key).generate(num_requests or DEFAULT_SYNTHETIC_REQUESTS, seed)
    else:
        counter = token_counter or make_token_counter(tokenizer_path)
        name = key if key in SHORT_NAMES else None
        fmt = fmt or SHORT_NAME_FORMATS.get(key)
        workload = read_trace_file(
            resolve_path(key), num_requests=num_requests, fmt=fmt, token_counter=counter, name=name
        )
    if rate is None and arrival in ("auto", "trace"):
        return workload
    return apply_arrivals(workload, arrival, rate=rate, cv=cv, seed=seed)
