"""The token budget: the one primitive every policy fills (tokens and sequences per step)."""

from __future__ import annotations


class TokenBudget:
    """Tokens and sequences left in the step being built."""

    __slots__ = ("max_seqs", "max_tokens", "num_seqs", "num_tokens")

    def __init__(self, max_tokens: int, max_seqs: int) -> None:
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self.num_tokens = 0
        self.num_seqs = 0

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.num_tokens

    @property
    def remaining_seqs(self) -> int:
        return self.max_seqs - self.num_seqs

    def can_fit(self, num_tokens: int, new_seq: bool = True) -> bool:
        seq_ok = not new_seq or self.num_seqs < self.max_seqs
        return seq_ok and self.num_tokens + num_tokens <= self.max_tokens

    def consume(self, num_tokens: int, new_seq: bool = True) -> None:
        self.num_tokens += num_tokens
        self.num_seqs += int(new_seq)

    def give_back(self, num_tokens: int, seq: bool = True) -> None:
        self.num_tokens -= num_tokens
        self.num_seqs -= int(seq)
