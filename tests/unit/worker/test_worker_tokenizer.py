"""Tokenizer: the demo MiniLM tokenizer (found through the installed package), round trips,
and incremental detokenization whose deltas add up to the full decode."""

from __future__ import annotations

import pytest

from sluice.common.tokenizer import Tokenizer, demo_tokenizer_path

TEXT = "The scheduler's playing with unbelievably long-running requests, isn't it? 42 tokens!"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.demo()


def test_demo_tokenizer_comes_from_the_installed_package(tok: Tokenizer) -> None:
    assert demo_tokenizer_path().name == "tokenizer.json"
    assert tok.vocab_size == 30522
    assert tok.eos_token_ids == (102,)


def test_encode_is_unpadded_unframed_and_decodes_back(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    assert 0 not in ids and 101 not in ids and 102 not in ids  # no [PAD], [CLS], [SEP]
    assert tok.decode(ids).startswith("the scheduler")  # MiniLM is uncased
    assert tok.encode(tok.decode(ids)) == ids


def test_incremental_deltas_add_up_to_the_full_text(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    prompt, generated = ids[:5], ids[5:]
    detok = tok.detokenizer(prompt)
    deltas = [detok.add(t) for t in generated]
    assert any(d.startswith(" ") for d in deltas) and any(d and not d.startswith(" ") for d in deltas)
    assert tok.decode(prompt) + "".join(deltas) == tok.decode(ids)
    assert detok.text == "".join(deltas)


def test_word_piece_continuations_attach_without_a_space(tok: Tokenizer) -> None:
    ids = tok.encode("unbelievably")
    assert len(ids) > 1
    detok = tok.detokenizer()
    assert "".join(detok.add(t) for t in ids) == "unbelievably"
