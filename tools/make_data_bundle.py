"""Regenerates data/, the small data set bundled in the repository, from the full data set.

    full data set (--source; default $SLUICE_DATA_DIR, else ../shared/data beside the checkout)
      -> BUNDLE: one Entry per bundled file (source path, bundled path, cut)
      -> data/<path>.gz         gzip level 9, mtime 0, no stored name: same input, same bytes
      -> data/CONTENT_SHA256    SHA-256 of each bundled file's content (after gunzip)

Cuts, all deterministic (no sampling, no randomness):
    whole             the file unchanged; its content hash is then the upstream file's SHA-256
    medians           a Vidur profile CSV with only its `time_stats.*.median` columns and every
                      non-timing column (what the cost model reads); rows unchanged and in order
    first_turns       ShareGPT: the first N conversations in file order, each cut to its first two
                      turns (the loader reads only those), one JSON object per line
    first_conversations  ShareGPT: the first N conversations whole (every turn: the multi-turn
                      trace needs them), lines unchanged
    first_generators  AlpacaEval: the leading lines of the first K generators (lines unchanged)

The prompt cuts are prefixes: loading the first n requests of the subset gives exactly the
first n requests of the full file, for every n the subset holds.

    python tools/make_data_bundle.py            # write data/ from the full set
    python tools/make_data_bundle.py --check    # regenerate in a temporary folder, compare, exit 1 on a difference
"""

from __future__ import annotations

import argparse
import csv
import gzip
import hashlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE_DIR = ROOT / "data"
SUMS_NAME = "CONTENT_SHA256"
SHAREGPT_CONVERSATIONS = 2_000
SHAREGPT_WHOLE_CONVERSATIONS = 300
ALPACA_GENERATORS = 2


@dataclass(frozen=True)
class Entry:
    source: str  # path in the full data set
    bundled: str  # path in data/ (".gz" for compressed files)
    cut: str  # a key of CUTS
    upstream_sha256: str = ""  # for `whole` files: the upstream file's SHA-256 (shared data README)


def _whole(path: Path) -> bytes:
    return path.read_bytes()


def _medians(path: Path) -> bytes:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    keep = [i for i, name in enumerate(rows[0]) if not name.startswith("time_stats.") or name.endswith(".median")]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows:
        writer.writerow([row[i] for i in keep])
    return out.getvalue().encode("utf-8")


def _gz_lines(path: Path) -> Iterator[bytes]:
    with gzip.open(path, "rb") as f:
        yield from f


def _first_turns(path: Path) -> bytes:
    out = []
    for i, line in enumerate(_gz_lines(path)):
        if i == SHAREGPT_CONVERSATIONS:
            break
        record = json.loads(line)
        record["conversations"] = record.get("conversations", [])[:2]
        out.append(json.dumps(record, ensure_ascii=False) + "\n")
    return "".join(out).encode("utf-8")


def _first_conversations(path: Path) -> bytes:
    """The first N conversations, every turn (multi-turn prompts need the whole conversation)."""
    out = []
    for i, line in enumerate(_gz_lines(path)):
        if i == SHAREGPT_WHOLE_CONVERSATIONS:
            break
        out.append(line)
    return b"".join(out)


def _first_generators(path: Path) -> bytes:
    seen: list[str] = []
    out = []
    for line in _gz_lines(path):
        generator = json.loads(line)["generator"]
        if generator not in seen:
            if len(seen) == ALPACA_GENERATORS:
                break
            seen.append(generator)
        out.append(line)
    return b"".join(out)


CUTS: dict[str, Callable[[Path], bytes]] = {
    "whole": _whole,
    "medians": _medians,
    "first_turns": _first_turns,
    "first_conversations": _first_conversations,
    "first_generators": _first_generators,
}

_TRACES = {
    "AzureLLMInferenceTrace_conv.csv": "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8",
    "AzureLLMInferenceTrace_code.csv": "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6",
    "vidur_arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv": (
        "9d3580538d915ca75e4aaaa54590b42dbb17abc6d74c8913310cf07c232adcdc"
    ),
    "sarathi_sharegpt_8k_filtered_stats_llama2_tokenizer.csv": (
        "6d6c296302a853e2669a674a96f269283e60c57e60363bd450588a1066919f9f"
    ),
    "mooncake_synthetic_trace.jsonl": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
}
_CODEALPACA = {
    "codealpaca_code_alpaca_2k.json": "9cb7352683bd2f530ce81eff7f8d58ccbe1a4bdf28afebbe9f80ec687256066d",
    "codealpaca_new_codealpaca.json": "2c8f4bb2dbce75ecc2020ded30f0fa935b7aa89d7be0c271f4ac208062f1bcb6",
}
_PROFILED_MODELS = {
    "a100": (
        "Qwen/Qwen-72B",
        "codellama/CodeLlama-34b-Instruct-hf",
        "internlm/internlm-20b",
        "meta-llama/Llama-2-70b-hf",
        "meta-llama/Llama-2-7b-hf",
        "meta-llama/Meta-Llama-3-70B",
        "meta-llama/Meta-Llama-3-8B",
        "microsoft/phi-2",
    ),
    "h100": (
        "Qwen/Qwen-72B",
        "codellama/CodeLlama-34b-Instruct-hf",
        "internlm/internlm-20b",
        "meta-llama/Llama-2-70b-hf",
        "meta-llama/Llama-2-7b-hf",
        "microsoft/phi-2",
    ),
}
_PROFILE_TABLES = (
    *(f"compute/{gpu}/{model}/mlp.csv" for gpu, models in _PROFILED_MODELS.items() for model in models),
    "legacy/e2d00e9/a100/attention.csv",
    "network/a100_dgx/all_reduce.csv",
    "network/h100_dgx/all_reduce.csv",
    "network/a100_dgx/send_recv.csv",
    "network/h100_dgx/send_recv.csv",
    "network/a100_pairwise_nvlink/send_recv.csv",
)

BUNDLE: tuple[Entry, ...] = (
    *(Entry(f"traces/{name}", f"traces/{name}.gz", "whole", sha) for name, sha in _TRACES.items()),
    *(Entry(f"prompts/{name}", f"prompts/{name}.gz", "whole", sha) for name, sha in _CODEALPACA.items()),
    Entry(
        "prompts/sharegpt_v3_conversations.jsonl.gz",
        "prompts/sharegpt_v3_conversations_2k_first_turns.jsonl.gz",
        "first_turns",
    ),
    Entry(
        "prompts/sharegpt_v3_conversations.jsonl.gz",
        "prompts/sharegpt_v3_conversations_300_whole.jsonl.gz",
        "first_conversations",
    ),
    Entry(
        "prompts/alpaca_eval_outputs_32models.jsonl.gz",
        "prompts/alpaca_eval_outputs_2models.jsonl.gz",
        "first_generators",
    ),
    *(Entry(f"profiles/vidur/{t}", f"profiles/vidur/{t}.gz", "medians") for t in _PROFILE_TABLES),
    Entry("profiles/vidur/LICENSE", "profiles/vidur/LICENSE", "whole"),
)


def content_bytes(path: Path) -> bytes:
    """A bundled file's content: gunzipped when it is a .gz file."""
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix != ".gz":
        path.write_bytes(data)
        return
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=raw, mtime=0) as gz:
        gz.write(data)


def build(source: Path, out: Path) -> dict[str, str]:
    """Write every bundled file under `out`; returns {bundled path: content SHA-256}."""
    sums = {}
    for entry in BUNDLE:
        data = CUTS[entry.cut](source / entry.source)
        if entry.upstream_sha256 and sha256(data) != entry.upstream_sha256:
            raise ValueError(f"{source / entry.source} is not the upstream file (SHA-256 {sha256(data)})")
        _write(out / entry.bundled, data)
        sums[entry.bundled] = sha256(data)
    (out / SUMS_NAME).write_text("".join(f"{h}  {p}\n" for p, h in sorted(sums.items())))
    return sums


def read_sums(folder: Path) -> dict[str, str]:
    lines = (folder / SUMS_NAME).read_text().splitlines()
    return {path: digest for digest, path in (line.split("  ", 1) for line in lines if line.strip())}


def default_source() -> Path | None:
    env = os.environ.get("SLUICE_DATA_DIR")
    candidates = ([Path(env)] if env else []) + [ROOT.parent / "shared" / "data"]
    return next((c for c in candidates if (c / BUNDLE[0].source).is_file()), None)


def check(source: Path, bundle: Path) -> list[str]:
    """Differences between `bundle` and a fresh build from `source` (empty when they agree)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = build(source, Path(tmp))
    committed = read_sums(bundle)
    problems = [f"{p}: regenerated content differs" for p, h in fresh.items() if committed.get(p) != h]
    problems += [f"{p}: listed in {SUMS_NAME} but not in the bundle spec" for p in committed if p not in fresh]
    for path, digest in committed.items():
        if not (bundle / path).is_file() or sha256(content_bytes(bundle / path)) != digest:
            problems.append(f"{path}: the committed file does not match {SUMS_NAME}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="the full data set (default $SLUICE_DATA_DIR or ../shared/data)")
    parser.add_argument("--out", type=Path, default=BUNDLE_DIR, help="the bundle folder (default data/)")
    parser.add_argument("--check", action="store_true", help="compare a fresh build with --out; write nothing")
    args = parser.parse_args(argv)
    source = args.source or default_source()
    if source is None:
        parser.error("no full data set found: give --source or set SLUICE_DATA_DIR")
    if args.check:
        problems = check(source, args.out)
        print("\n".join(problems) or f"{args.out}: {len(BUNDLE)} files agree with {source}")
        return 1 if problems else 0
    sums = build(source, args.out)
    size = sum((args.out / p).stat().st_size for p in sums)
    print(f"wrote {len(sums)} files, {size / 2**20:.2f} MiB, to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
