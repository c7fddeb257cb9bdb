"""Token counters for text formats (ShareGPT, AlpacaEval, CodeAlpaca): text in, token count out.

The default, `WordTokenCounter(1.3)`, is deterministic and needs no dependency:
ceil(1.3 x whitespace-separated words), the tokens-per-word ratio of English prose with
Llama- or GPT-style tokenizers that `shared/data/README.md` (prompts/) quotes. Code and
non-English text run higher, so give a real tokenizer (`HFTokenizerCounter`, a
`tokenizer.json` read by the optional `tokenizers` package) when lengths must be exact.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from typing import Protocol


class TokenCounter(Protocol):
    name: str

    def __call__(self, text: str) -> int: ...


class WordTokenCounter:
    def __init__(self, tokens_per_word: float = 1.3) -> None:
        if tokens_per_word <= 0:
            raise ValueError(f"tokens_per_word must be > 0, got {tokens_per_word}")
        # NOTE: an exact fraction, so that 10 words x 1.3 is 13 tokens and not ceil(13.000000000000002) = 14.
        self._ratio = Fraction(str(tokens_per_word)).limit_denominator(10_000)
        self.name = f"words x {tokens_per_word}"

    def __call__(self, text: str) -> int:
        words = len(text.split())
        return math.ceil(words * self._ratio)


class HFTokenizerCounter:
    def __init__(self, tokenizer_path: str | Path) -> None:
        path = Path(tokenizer_path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} not found (expected a Hugging Face tokenizer.json)")
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ImportError("counting with a tokenizer.json needs the `tokenizers` package") from exc
        self._tokenizer = Tokenizer.from_file(str(path))
        # NOTE: encoder tokenizer.json files (MiniLM's) pad and truncate to 128: a count must not.
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self.name = "tokenizer " + "/".join(path.parts[-3:])

    def __call__(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]


DEFAULT_TOKEN_COUNTER = WordTokenCounter(1.3)


def make_token_counter(tokenizer_path: str | Path | None = None) -> TokenCounter:
    return HFTokenizerCounter(tokenizer_path) if tokenizer_path is not None else DEFAULT_TOKEN_COUNTER
