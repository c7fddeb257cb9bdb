"""Reading trace files as streams: gzip by magic bytes, CSV rows, JSON Lines, and JSON arrays
decoded one object at a time, so a loader that needs only the first N requests stops early
and never holds a whole large file in memory. `read_head` is what format detection sees.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from scheduler_service.workloads.base import FileHead
from sluice.common.paths import open_text

_CHUNK_CHARS = 1 << 20


def iter_csv_rows(path: Path) -> Iterator[dict[str, str]]:
    with open_text(path) as stream:
        reader = csv.DictReader(stream)
        reader.fieldnames = [name.strip() for name in reader.fieldnames or []]
        yield from reader


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with open_text(path) as stream:
        for line_no, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_no}: expected a JSON object per line, got {type(record).__name__}")
            yield record


def iter_json_array(path: Path) -> Iterator[dict[str, Any]]:
    """Objects of a top-level JSON array, decoded incrementally from 1 MiB chunks."""
    decoder = json.JSONDecoder()
    with open_text(path) as stream:
        buf = stream.read(_CHUNK_CHARS).lstrip()
        if not buf.startswith("["):
            raise ValueError(f"{path}: expected a JSON array")
        pos = 1
        while True:
            pos = _skip_separators(buf, pos)
            if pos >= len(buf):
                buf, pos = _refill(stream, buf, pos, path)
                continue
            if buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                # NOTE: the object runs past the chunk; read more and decode it again from its start.
                buf, pos = _refill(stream, buf, pos, path)
                continue
            if not isinstance(record, dict):
                raise ValueError(f"{path}: expected an array of objects, found {type(record).__name__}")
            yield record
            pos = end


def _skip_separators(buf: str, pos: int) -> int:
    while pos < len(buf) and (buf[pos].isspace() or buf[pos] == ","):
        pos += 1
    return pos


def _refill(stream: IO[str], buf: str, pos: int, path: Path) -> tuple[str, int]:
    more = stream.read(_CHUNK_CHARS)
    if not more:
        raise ValueError(f"{path}: JSON array ends early or holds invalid JSON near character {pos}")
    return buf[pos:] + more, 0


def iter_json_records(path: Path) -> Iterator[dict[str, Any]]:
    """JSON objects of a file that is either one JSON array or JSON Lines (either may be gzip)."""
    with open_text(path) as stream:
        first = stream.read(64).lstrip()
    return iter_json_array(path) if first.startswith("[") else iter_jsonl(path)


def read_head(path: Path) -> FileHead:
    with open_text(path) as stream:
        start = stream.read(4096).lstrip()
    if start.startswith("["):
        return FileHead(path, "json-array", first_record=next(iter_json_array(path), None))
    if start.startswith("{"):
        return FileHead(path, "jsonl", first_record=next(iter_jsonl(path), None))
    first_line = start.splitlines()[0] if start else ""
    columns = next(csv.reader([first_line]), [])
    return FileHead(path, "csv", columns=tuple(c.strip() for c in columns))
