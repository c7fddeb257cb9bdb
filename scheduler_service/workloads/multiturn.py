"""`sharegpt-multiturn`: every turn of the ShareGPT conversations as a request whose prompt is
the conversation so far, tokenized with a real tokenizer, so prefix caching sees the prefixes
that chat traffic shares (each turn's prompt starts with the previous turn's prompt and answer).

    conversation  [human h1, gpt g1, human h2, gpt g2, ...]
    turn 1        prompt = U h1 A                output = g1
    turn 2        prompt = U h1 A g1 U h2 A      output = g2      (U, A: role headers)

Each message is tokenized alone and the ids are concatenated, as a chat template does (the
role headers stop merges across messages), so turn k+1's prompt ids start with exactly turn
k's prompt and answer ids. Requests carry `prompt_token_ids` (the simulator hashes them for
prefix caching) and `output_token_ids` (the reference answer: the next turn's prompt holds it,
so a simulated answer's blocks are named by it) and the prompt text (for live replay).

Order: like the Mooncake trace (a Poisson process that keeps the order of turns within each
conversation), conversations are served as `NUM_SESSIONS` concurrent sessions; the next
request is the next turn of a session drawn at random (a fixed seed, so the trace is one
order), and a finished conversation's slot goes to the next one in file order. With arrivals
at rate r, a user's next turn comes on average NUM_SESSIONS / r seconds after the previous one.

Conversations whose roles do not alternate human, gpt from the start are skipped; a turn with
an empty question or answer ends its conversation there. Both are counted in the metadata.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler_service.workloads.base import FileHead, ReadOptions, TraceFormat, TraceRequest, register_format
from scheduler_service.workloads.fileio import iter_json_records
from scheduler_service.workloads.tokens import HFTokenizerCounter

# NOTE: 64 users talking at once: at 8 req/s a user's next turn comes 8 s after the last on
# average, a reading-and-typing pause, and enough for a 300-token answer to be generated
# (about 4 s on an 8B model) before the turn that contains it arrives.
NUM_SESSIONS = 64
SESSION_SEED = 0
USER_HEADER, ASSISTANT_HEADER = "user :", "assistant :"
_HUMAN = {"human", "user"}
_ASSISTANT = {"gpt", "assistant", "chatgpt"}

Encoder = Callable[[list[str]], list[list[int]]]


@dataclass
class _Conversation:
    conv_id: str
    turns: list[tuple[list[int], list[int], str, str]]  # (question ids, answer ids, question, answer)
    next_turn: int = 0
    context_ids: tuple[int, ...] = ()
    context_text: str = ""


def _messages(record: dict[str, Any]) -> list[tuple[str, str]] | None:
    """(role, text) pairs alternating human, gpt; None when the roles do not."""
    out = []
    for i, turn in enumerate(record.get("conversations") or []):
        role = str(turn.get("from", turn.get("role", ""))).lower()
        expected = _HUMAN if i % 2 == 0 else _ASSISTANT
        if role not in expected:
            return None
        out.append((role, str(turn.get("value", turn.get("content", "")))))
    return out


def _conversations(path: Path, encode: Encoder, skipped: Counter[str]) -> Iterator[_Conversation]:
    for i, record in enumerate(iter_json_records(path)):
        messages = _messages(record)
        if messages is None or len(messages) < 2:
            skipped["roles_not_human_gpt_alternating"] += 1
            continue
        texts = [text for _, text in messages[: len(messages) // 2 * 2]]
        ids = encode(texts)
        turns = []
        for q in range(0, len(texts), 2):
            if not ids[q] or not ids[q + 1]:
                skipped["turn_with_empty_question_or_answer"] += 1
                break
            turns.append((ids[q], ids[q + 1], texts[q], texts[q + 1]))
        if turns:
            yield _Conversation(str(record.get("id", i)), turns)


def _next_request(conv: _Conversation, headers: tuple[list[int], list[int]]) -> TraceRequest:
    question, answer, q_text, a_text = conv.turns[conv.next_turn]
    user, assistant = headers
    prompt_ids = (*conv.context_ids, *user, *question, *assistant)
    prompt_text = f"{conv.context_text}{USER_HEADER} {q_text}\n{ASSISTANT_HEADER} "
    request = TraceRequest(
        request_id=f"{conv.conv_id}#t{conv.next_turn + 1}",
        arrival_s=None,
        prompt_tokens=len(prompt_ids),
        output_tokens=len(answer),
        prompt_text=prompt_text,
        prompt_token_ids=prompt_ids,
        source="sharegpt-multiturn",
        output_token_ids=tuple(answer),
    )
    conv.context_ids = (*prompt_ids, *answer)
    conv.context_text = f"{prompt_text}{a_text}\n"
    conv.next_turn += 1
    return request


def _encoder(opts: ReadOptions) -> tuple[Encoder, str]:
    counter = opts.token_counter
    if isinstance(counter, HFTokenizerCounter):
        return counter.encode_batch, counter.name
    from sluice.common.tokenizer import demo_tokenizer_path

    demo = HFTokenizerCounter(demo_tokenizer_path())
    return demo.encode_batch, demo.name


def read_sharegpt_multiturn(path: Path, opts: ReadOptions) -> tuple[list[TraceRequest], dict[str, Any]]:
    encode, tokenizer = _encoder(opts)
    user, assistant = encode([USER_HEADER, ASSISTANT_HEADER])
    skipped: Counter[str] = Counter()
    source = _conversations(path, encode, skipped)
    sessions: list[_Conversation] = []
    requests: list[TraceRequest] = []
    pick = random.Random(SESSION_SEED)
    limit = opts.num_requests
    while limit is None or len(requests) < limit:
        while len(sessions) < NUM_SESSIONS and (conv := next(source, None)) is not None:
            sessions.append(conv)
        if not sessions:
            break
        i = pick.randrange(len(sessions))
        conv = sessions[i]
        requests.append(_next_request(conv, (user, assistant)))
        if conv.next_turn == len(conv.turns):
            sessions[i] = sessions[-1]
            sessions.pop()
    meta = {
        "skipped": dict(skipped),
        "tokenizer": tokenizer,
        "sessions": NUM_SESSIONS,
        "prefix_share": _share(requests),
    }
    return requests, meta


def _share(requests: list[TraceRequest]) -> float:
    """Share of prompt tokens that are an earlier turn's prompt and answer (the most prefix
    caching can skip)."""
    total = sum(r.prompt_tokens for r in requests)
    earlier: dict[str, int] = {}
    reused = 0
    for r in requests:
        conv = r.request_id.rpartition("#t")[0]
        reused += earlier.get(conv, 0)
        earlier[conv] = r.prompt_tokens + r.output_tokens
    return reused / total if total else 0.0


def _never_detected(head: FileHead) -> bool:
    return False  # NOTE: same file as `sharegpt`; chosen by name (`sharegpt-multiturn`), never detected


register_format(
    TraceFormat(
        "sharegpt-multiturn",
        "ShareGPT conversations, every turn with the conversation so far as its prompt (token ids)",
        _never_detected,
        read_sharegpt_multiturn,
    )
)
