"""Block hashes: what identifies a request's full KV blocks for automatic prefix caching.

Block j of a request (tokens [j*B, (j+1)*B) of prompt + generated) is named by a hash
chained over everything before it, so two requests share block j exactly when they share
every token up to its end (vLLM's block hashes, SGLang's radix path at block granularity):

    h_0 = H(ROOT, tokens[0:B])      h_j = H(h_{j-1}, tokens[j*B:(j+1)*B])

What "tokens" means depends on what the request knows:

    token ids (live, and traces with text)   the ids themselves: blake2b-128 over parent and ids,
                                             so a crafted prompt cannot collide with another's prefix
    Mooncake hash_ids (trace, no text)       one id per `trace_block_tokens` (512) tokens; block j
                                             is named by the ids of the trace blocks it overlaps
                                             and its index, so 32 of our 16-token blocks map onto
                                             one trace block
    nothing (synthetic lengths, outputs of   a salt unique to the request: its blocks are reused only
    a simulated request)                     by itself (after a recompute preemption, or a slice)

Hashes are computed once per request, lazily up to the blocks asked for, and kept on the
request (`Request.block_hashes`); `block_hashes(req, block_size, n)` extends them.

What can be shared (`shareable_blocks`): the leading blocks named by tokens or trace ids. The
first salted block ends that run (every later hash chains on it, so it is unique too). Salted
blocks are found again only by their own request, after its KV was freed and before it ends;
the scheduler hashes and registers them only then (`Scheduler.flush_blocks`), and a lookup
for a request none of whose salted blocks was ever hashed stops at its shareable run
(`lookup_hashes`): a trace without shared prefixes costs no hashing at all. A request with no
shareable block at all (`owns_blocks`) is not hashed even then: its freed KV waits as its own
LRU run, which its lookup finds and its re-admission takes back whole (`cached_prefix`,
`KVCacheManager.free_owned`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

ROOT_HASH = 0x5EED_0F_B10C_4A5E  # the parent of every request's first block
_TRACE, _SALTED = 1, 2  # payload tags, so the three kinds of block can never name each other


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """A simulated request's block identity when its token ids are not the whole story."""

    trace_hash_ids: tuple[int, ...] = ()  # Mooncake `hash_ids`, one per trace block of the prompt
    trace_block_tokens: int = 512
    output_token_ids: tuple[int, ...] | None = None  # the reference answer (a multi-turn trace's next prompt holds it)


class Request(Protocol):
    """What hashing reads and keeps on a request (core/request.py's Request; a Protocol, so
    that the request module can import this one)."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_token_ids: Sequence[int] | None
    output_token_ids: list[int]
    prefix_source: PrefixSource | None
    prefix_salt: int | None
    block_hashes: list[int] | None


def request_salt(request_id: str) -> int:
    """A per-request constant (deterministic across processes, unlike `hash(str)`)."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=8).digest(), "little")


def hash_token_block(parent: int, token_ids: Sequence[int]) -> int:
    digest = hashlib.blake2b(parent.to_bytes(16, "little"), digest_size=16)
    digest.update(array("i", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def block_hashes(req: Request, block_size: int, num_blocks: int) -> list[int]:
    """The request's first `num_blocks` block hashes (fewer if fewer of its blocks are full)."""
    hashes = req.block_hashes
    if hashes is None:
        hashes = req.block_hashes = []
    upto = min(num_blocks, (req.num_prompt_tokens + req.num_output_tokens) // block_size)
    if len(hashes) >= upto:
        return hashes
    parent = hashes[-1] if hashes else ROOT_HASH
    src = req.prefix_source
    for j in range(len(hashes), upto):
        parent = _hash_block(req, src, j, block_size, parent)
        hashes.append(parent)
    return hashes


NO_LIMIT = 1 << 62  # "every block": live requests name all their blocks by token ids


def shareable_blocks(req: Request, block_size: int) -> int:
    """How many leading blocks of the request other requests can name (the run before its
    first salted block); NO_LIMIT when every block is named by its tokens."""
    src, prompt, ids = req.prefix_source, req.num_prompt_tokens, req.prompt_token_ids
    if src is None:
        return NO_LIMIT if ids is not None else 0
    if ids is not None:
        out = src.output_token_ids
        return (prompt + len(out)) // block_size if out is not None else prompt // block_size
    return min(prompt, len(src.trace_hash_ids) * src.trace_block_tokens) // block_size


def lookup_hashes(req: Request, block_size: int, limit: int) -> list[int]:
    """The hashes of the request's first `limit` blocks worth looking up: past its shareable
    run only when one of its salted blocks was hashed (hence possibly registered) before."""
    if req.prefix_salt is None:
        limit = min(limit, shareable_blocks(req, block_size))
    return block_hashes(req, block_size, limit) if limit > 0 else []


class _PrefixCache(Protocol):
    """What `cached_prefix` asks of a worker's KV (kvstore/accounting.py's KVCacheManager)."""

    block_size: int
    hashed: set[str]

    def owned_prefix(self, request_id: str, limit: int) -> list[int] | None: ...

    def lookup_prefix(self, hashes: Sequence[int]) -> list[int]: ...


def owns_blocks(req: Request, kv: _PrefixCache) -> bool:
    """Only the request itself can ever name its blocks (none is named by tokens or trace ids)
    and they are not registered on this worker: its freed KV waits there as its own run
    (`KVCacheManager.free_owned`), never hashed."""
    return req.request_id not in kv.hashed and shareable_blocks(req, kv.block_size) == 0


def cached_prefix(kv: _PrefixCache, req: Request, limit: int) -> list[int]:
    """The worker's cached blocks of the request's first `limit` blocks (longest prefix): its
    own run when it owns its blocks, else a lookup of its hashes (`lookup_hashes`)."""
    if limit <= 0:
        return []
    if req.prefix_salt is not None and owns_blocks(req, kv):
        hit = kv.owned_prefix(req.request_id, limit)
        if hit is not None:
            return hit
    return kv.lookup_prefix(lookup_hashes(req, kv.block_size, limit))


def _hash_block(req: Request, src: PrefixSource | None, j: int, size: int, parent: int) -> int:
    start, end, prompt = j * size, (j + 1) * size, req.num_prompt_tokens
    if src is None:
        tokens = _known_tokens(req, start, end)
        return hash_token_block(parent, tokens) if tokens is not None else _salted(req, parent, j)
    if end <= prompt:
        if req.prompt_token_ids is not None:
            return hash_token_block(parent, req.prompt_token_ids[start:end])
        ids, per = src.trace_hash_ids, src.trace_block_tokens
        last = (end - 1) // per
        if last < len(ids):
            return hash((parent, _TRACE, ids[start // per], ids[last], j))
        return _salted(req, parent, j)
    tokens = _reference_tokens(req, src, start, end)
    return hash_token_block(parent, tokens) if tokens is not None else _salted(req, parent, j)


def _known_tokens(req: Request, start: int, end: int) -> list[int] | None:
    """Live requests: prompt ids then the ids generated so far."""
    prompt_ids = req.prompt_token_ids
    if prompt_ids is None:
        return None
    prompt = req.num_prompt_tokens
    if end <= prompt:
        return list(prompt_ids[start:end])
    head = list(prompt_ids[start:prompt]) if start < prompt else []
    return head + req.output_token_ids[max(0, start - prompt) : end - prompt]


def _reference_tokens(req: Request, src: PrefixSource, start: int, end: int) -> list[int] | None:
    """Simulated requests past their prompt: the trace's reference answer, when it has one."""
    out = src.output_token_ids
    prompt = req.num_prompt_tokens
    if out is None or req.prompt_token_ids is None or end - prompt > len(out):
        return None
    head = list(req.prompt_token_ids[start:prompt]) if start < prompt else []
    return head + list(out[max(0, start - prompt) : end - prompt])


def _salted(req: Request, parent: int, j: int) -> int:
    if req.prefix_salt is None:
        req.prefix_salt = request_salt(req.request_id)
    return hash((parent, _SALTED, req.prefix_salt, j))
