"""JSON trace and prompt-set readers, each registered in TRACE_FORMATS and recognised by the
keys of the file's first record (JSON Lines or one JSON array, either possibly gzip).

- `mooncake`: Mooncake FAST'25 traces: `timestamp` (ms), `input_length`, `output_length`,
  `hash_ids` (512-token prefix-block hashes, kept as `prefix_hash_ids`).
- `sharegpt`: ShareGPT conversations (`conversations: [{from, value}]`): the request is the
  first two turns when they are a non-empty human -> gpt pair, the usual ShareGPT serving
  sample (`shared/data/README.md`); other conversations are skipped and counted.
- `alpaca-eval`: AlpacaEval model outputs (`instruction`, `output`, `generator`).
- `codealpaca`: Code Alpaca (`instruction`, `input`, `output`); the prompt is the
  instruction followed by the input.

Text formats keep the prompt text and count prompt and output tokens with the caller's
token counter (see tokens.py). Requests with an empty prompt or output are skipped and
counted in the metadata: a request must prefill and generate at least one token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from scheduler_service.workloads.base import FileHead, ReadOptions, TraceFormat, TraceRequest, register_format
from scheduler_service.workloads.fileio import iter_json_records, iter_jsonl

_HUMAN = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "chatgpt"}


def _has_keys(*keys: str, kinds: tuple[str, ...] = ("jsonl", "json-array")) -> Callable[[FileHead], bool]:
    def matches(head: FileHead) -> bool:
        return head.kind in kinds and head.first_record is not None and set(keys) <= head.first_record.keys()

    return matches


def read_mooncake(path: Path, opts: ReadOptions) -> tuple[list[TraceRequest], dict[str, Any]]:
    requests: list[TraceRequest] = []
    first_ms: float | None = None
    for i, record in enumerate(iter_jsonl(path)):
        if opts.num_requests is not None and len(requests) >= opts.num_requests:
            break
        stamp_ms = float(record["timestamp"])
        first_ms = stamp_ms if first_ms is None else first_ms
        requests.append(
            TraceRequest(
                request_id=str(i),
                arrival_s=(stamp_ms - first_ms) / 1000.0,
                prompt_tokens=int(record["input_length"]),
                output_tokens=int(record["output_length"]),
                source="mooncake",
                prefix_hash_ids=tuple(int(h) for h in record.get("hash_ids", ())),
            )
        )
    return requests, {"prefix_block_tokens": 512}


def _text_request(
    request_id: str, prompt: str, output: str, source: str, opts: ReadOptions, skipped: Counter[str]
) -> TraceRequest | None:
    prompt_tokens, output_tokens = opts.token_counter(prompt), opts.token_counter(output)
    if prompt_tokens == 0:
        skipped["empty_prompt"] += 1
        return None
    if output_tokens == 0:
        skipped["empty_output"] += 1
        return None
    return TraceRequest(request_id, None, prompt_tokens, output_tokens, prompt_text=prompt, source=source)


def _collect(
    records: Iterator[tuple[str, str, str, str] | str], opts: ReadOptions, skipped: Counter[str]
) -> list[TraceRequest]:
    """Turn (id, prompt, output, source) tuples into requests; a bare string is a skip reason."""
    requests: list[TraceRequest] = []
    for item in records:
        if opts.num_requests is not None and len(requests) >= opts.num_requests:
            break
        if isinstance(item, str):
            skipped[item] += 1
            continue
        request = _text_request(*item, opts=opts, skipped=skipped)
        if request is not None:
            requests.append(request)
    return requests


def _turn_text(turn: dict[str, Any]) -> tuple[str, str]:
    role = str(turn.get("from", turn.get("role", ""))).lower()
    return role, str(turn.get("value", turn.get("content", "")))


def _sharegpt_pairs(path: Path) -> Iterator[tuple[str, str, str, str] | str]:
    for i, record in enumerate(iter_json_records(path)):
        turns = record.get("conversations") or []
        if len(turns) < 2:
            yield "fewer_than_two_turns"
            continue
        (role0, prompt), (role1, output) = _turn_text(turns[0]), _turn_text(turns[1])
        if role0 not in _HUMAN or role1 not in _ASSISTANT:
            yield "first_turns_not_human_gpt"
            continue
        yield str(record.get("id", i)), prompt, output, "sharegpt"


def read_sharegpt(path: Path, opts: ReadOptions) -> tuple[list[TraceRequest], dict[str, Any]]:
    skipped: Counter[str] = Counter()
    requests = _collect(_sharegpt_pairs(path), opts, skipped)
    return requests, {"skipped": dict(skipped), "pair": "first two turns, human -> gpt"}


def _instruction_prompt(record: dict[str, Any]) -> str:
    extra = str(record.get("input") or "")
    instruction = str(record.get("instruction") or "")
    return f"{instruction}\n{extra}" if extra.strip() else instruction


def _alpaca_eval_items(path: Path) -> Iterator[tuple[str, str, str, str]]:
    for i, record in enumerate(iter_json_records(path)):
        generator = str(record.get("generator", ""))
        request_id = f"{record.get('instruction_id', i)}:{generator}" if generator else str(i)
        source = f"alpaca-eval/{generator}" if generator else "alpaca-eval"
        yield request_id, _instruction_prompt(record), str(record.get("output") or ""), source


def read_alpaca_eval(path: Path, opts: ReadOptions) -> tuple[list[TraceRequest], dict[str, Any]]:
    skipped: Counter[str] = Counter()
    requests = _collect(_alpaca_eval_items(path), opts, skipped)
    return requests, {"skipped": dict(skipped)}


def _codealpaca_items(path: Path) -> Iterator[tuple[str, str, str, str]]:
    for i, record in enumerate(iter_json_records(path)):
        yield str(i), _instruction_prompt(record), str(record.get("output") or ""), "codealpaca"


def read_codealpaca(path: Path, opts: ReadOptions) -> tuple[list[TraceRequest], dict[str, Any]]:
    skipped: Counter[str] = Counter()
    requests = _collect(_codealpaca_items(path), opts, skipped)
    return requests, {"skipped": dict(skipped), "prompt": "instruction + newline + input"}


def _is_codealpaca(head: FileHead) -> bool:
    return _has_keys("instruction", "input", "output")(head)


def _is_alpaca_eval(head: FileHead) -> bool:
    return _has_keys("instruction", "output")(head) and not _is_codealpaca(head)


register_format(
    TraceFormat(
        "mooncake",
        "Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)",
        _has_keys("timestamp", "input_length", "output_length", kinds=("jsonl",)),
        read_mooncake,
    )
)
register_format(
    TraceFormat(
        "sharegpt",
        "ShareGPT conversations, JSON or JSONL (first human -> gpt pair)",
        _has_keys("conversations"),
        read_sharegpt,
    )
)
register_format(
    TraceFormat(
        "alpaca-eval", "AlpacaEval outputs JSONL (instruction, output, generator)", _is_alpaca_eval, read_alpaca_eval
    )
)
register_format(
    TraceFormat("codealpaca", "Code Alpaca JSON array (instruction, input, output)", _is_codealpaca, read_codealpaca)
)
