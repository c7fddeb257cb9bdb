"""Worker-to-worker KV transfer (disaggregated prefill and decode): OfferKv, PullKv, ReadKv.

    scheduler --OfferKv(blocks, int8)--> prefill worker          (lease)  -> one-time token
    scheduler --PullKv(peer, token, dst blocks)--> decode worker  (lease)
        decode worker --ReadKv(token as x-sluice-kv-token)--> prefill worker
        <-- ReadKvResponse stream: runs of blocks, in the swap format (`KVBlocks.export_blocks`)
        each chunk written into the decode worker's blocks as it arrives
    scheduler <-- PullKvResponse(blocks, bytes, seconds)

Who may touch the KV: OfferKv and PullKv need the worker's lease, as Execute does, so only
the scheduler driving both workers starts a transfer. ReadKv needs no lease (the decode worker
does not hold the prefill worker's session, and must not: it would let it drive that worker);
its capability is the token OfferKv minted: random, bound to the offered blocks, readable once,
lapsing after `ttl_s` or at the next Warmup, compared in constant time. Nobody else can read
the offered KV, and nobody can write a worker's KV but its own lease holder (PullKv).

Reads and writes go through the EngineRunner's lock one chunk at a time, on the event loop
(a chunk of about 4 MiB is a copy of a few milliseconds), so steps keep running between
chunks: a transfer overlaps the prefill worker's next prefill and the decode worker's decodes.
The decode worker refuses (ABORTED) to write blocks that a request it holds owns: the
scheduler reserved them for this request, so such a write means the two have diverged.
A later PullKv into the same blocks supersedes an earlier one still running: the scheduler
only reuses a transfer's blocks after it gave that transfer up (a timeout, a lost peer), so
the earlier pull's remaining chunks are refused (ABORTED), never written over the new KV.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import numpy as np
import torch

from sluice.common.grpc_server import KEEPALIVE
from sluice.common.security import PLAINTEXT, ClientSecurity
from sluice.v1 import worker_pb2

if TYPE_CHECKING:  # for the annotations only
    from worker_service.engine_contract import Engine, KVBlocks


class RunsEngine(Protocol):
    """What the transfers need of the server's EngineRunner (named here, so this module does not
    import the server that imports it)."""

    engine: Engine

    @property
    def ready(self) -> bool: ...

    @property
    def not_ready_reason(self) -> str: ...

    async def call_inline(self, fn: Callable[..., Any], *args: Any) -> Any: ...


log = logging.getLogger(__name__)

TOKEN_KEY = "x-sluice-kv-token"
SERVICE = "sluice.v1.WorkerService"
READ_KV_METHOD = f"/{SERVICE}/ReadKv"
DEFAULT_OFFER_TTL_S = 30.0
MAX_OFFER_TTL_S = 600.0
CHUNK_BYTES = 4 * 2**20  # about this much per streamed chunk when the caller does not say (benchmarks/kv_transfer.py)


class TransferRefused(Exception):
    """A transfer call refused; `code` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Offer:
    request_id: str
    block_ids: tuple[int, ...]
    int8: bool
    expires_at: float


class KVOffers:
    """The prefill worker's open offers, by one-time token."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._offers: dict[str, Offer] = {}

    def __len__(self) -> int:
        return len(self._offers)

    def add(self, request_id: str, block_ids: Sequence[int], int8: bool, ttl_s: float) -> str:
        self._expire()
        token = secrets.token_urlsafe(24)
        self._offers[token] = Offer(request_id, tuple(block_ids), int8, self.clock() + ttl_s)
        return token

    def take(self, presented: str | None) -> Offer:
        """The offer of `presented`, removed (a token reads once); TransferRefused otherwise."""
        self._expire()
        if presented is None:
            raise TransferRefused(
                "FAILED_PRECONDITION", f"{TOKEN_KEY} metadata missing: send the token OfferKv answered"
            )
        for token in list(self._offers):
            if secrets.compare_digest(token.encode(), presented.encode()):
                return self._offers.pop(token)
        raise TransferRefused(
            "PERMISSION_DENIED", f"{TOKEN_KEY}: no open offer has this token (read already, lapsed, or never made)"
        )

    def clear(self) -> None:
        self._offers.clear()

    def _expire(self) -> None:
        now = self.clock()
        for token in [t for t, o in self._offers.items() if o.expires_at <= now]:
            del self._offers[token]


def token_of(metadata: Sequence[tuple[str, object]] | None) -> str | None:
    for key, value in metadata or ():
        if key == TOKEN_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def check_block_ids(block_ids: Sequence[int], num_gpu_blocks: int, field: str) -> None:
    if not block_ids:
        raise TransferRefused("INVALID_ARGUMENT", f"{field}: at least one block")
    if len(set(block_ids)) != len(block_ids):
        raise TransferRefused("INVALID_ARGUMENT", f"{field}: a block appears twice")
    bad = [b for b in block_ids if b >= num_gpu_blocks]
    if bad:
        raise TransferRefused(
            "INVALID_ARGUMENT", f"{field}: block {bad[0]} out of range (the cache has {num_gpu_blocks})"
        )


def offer_ttl(ttl_s: float) -> float:
    if ttl_s == 0:
        return DEFAULT_OFFER_TTL_S
    if not 0 < ttl_s <= MAX_OFFER_TTL_S or math.isnan(ttl_s):
        raise TransferRefused("INVALID_ARGUMENT", f"ttl_s: must be in (0, {MAX_OFFER_TTL_S:g}], got {ttl_s}")
    return ttl_s


@dataclass(frozen=True, slots=True)
class ChunkView:
    """A ReadKvResponse whose data is a view of the received message, not a copy of it."""

    first: int
    num_blocks: int
    int8: bool
    data: memoryview


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def parse_chunk(message: bytes) -> ChunkView:
    """Decodes a serialized ReadKvResponse (one chunk) without copying its data.

    NOTE: protobuf's parser copies the data into the message and again on each read of the
    field; at a megabyte per chunk those two copies cost as much as the transfer's own copy
    into the cache. The wire format is ReadKvResponse's, so any other client reads it with protobuf.
    """
    buf = memoryview(message)
    fields: dict[int, int] = {}
    data = buf[0:0]
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            fields[number], pos = _varint(buf, pos)
        elif wire_type == 2:
            length, pos = _varint(buf, pos)
            if number == 4:
                data = buf[pos : pos + length]
            pos += length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"ReadKvResponse: unsupported wire type {wire_type} of field {number}")
    if pos != len(buf):
        raise ValueError("ReadKvResponse: truncated message")
    return ChunkView(fields.get(1, 0), fields.get(2, 0), bool(fields.get(3, 0)), data)


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_chunk(first: int, num_blocks: int, int8: bool, data: bytes) -> bytes:
    """A serialized ReadKvResponse, the data copied once (protobuf copies it into the message,
    then again when serializing it)."""
    header = worker_pb2.ReadKvResponse(first=first, num_blocks=num_blocks, int8=int8).SerializeToString()
    return b"".join((header, b"\x22", _encode_varint(len(data)), data))  # 0x22: field 4, length-delimited


def add_read_kv_handler(server: grpc.aio.Server, read_kv: Callable[..., AsyncIterator[bytes]]) -> None:
    """Registers ReadKv with a pass-through serializer, for a handler that yields `encode_chunk`
    bytes. Call after the generated servicer's registration: a registered handler takes
    precedence over the generic one, and the last registration of a method wins."""
    handler = grpc.unary_stream_rpc_method_handler(
        read_kv, request_deserializer=worker_pb2.ReadKvRequest.FromString, response_serializer=_same_bytes
    )
    server.add_registered_method_handlers(SERVICE, {"ReadKv": handler})


def _same_bytes(message: bytes) -> bytes:
    return message


def chunk_spans(block_ids: Sequence[int], per_chunk: int) -> list[tuple[int, int]]:
    """(position, length) of each chunk: at most per_chunk blocks, and no chunk spans a gap in
    the block ids, so each chunk is one run of the cache, copied once (KVBlocks.export_blocks)."""
    spans: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1 or i - start == per_chunk:
            spans.append((start, i - start))
            start = i
    return spans


def _rows(data: bytes | memoryview, num_blocks: int) -> torch.Tensor:
    """A chunk's bytes as [num_blocks, bytes per block] uint8, without a copy."""
    with warnings.catch_warnings():
        # NOTE: the tensor views the message's immutable bytes; it is only read (copied into
        # the cache), so torch's warning about non-writable arrays does not apply.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).reshape(num_blocks, -1))


def default_blocks_per_chunk(bytes_per_block: int) -> int:
    return max(1, CHUNK_BYTES // max(bytes_per_block, 1))


class KVTransferHandler:
    """The three transfer calls over one worker's engine runner (the servicer checks the lease).

    `runner` is the server's EngineRunner (engine, lock, readiness); `peer_security` dials
    peers (TLS and the API key a peer wants, the same a scheduler would present)."""

    def __init__(self, runner: RunsEngine, peer_security: ClientSecurity = PLAINTEXT) -> None:
        self.runner = runner
        self.offers = KVOffers()
        self.peer_security = peer_security
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._writers: dict[int, object] = {}  # block -> the latest pull writing it (its fence)

    @property
    def _engine(self) -> Engine:
        return self.runner.engine

    def _cache(self) -> KVBlocks:
        cache = self._engine.cache  # NOTE: None: no KV (the echo engine) or no Warmup yet
        if not self.runner.ready or cache is None:
            raise TransferRefused("UNAVAILABLE", self.runner.not_ready_reason or "this worker's engine keeps no KV")
        return cache

    # -- prefill side ------------------------------------------------------------------------

    def offer(self, request: worker_pb2.OfferKvRequest) -> worker_pb2.OfferKvResponse:
        cache = self._cache()
        check_block_ids(request.block_ids, cache.num_gpu_blocks, "block_ids")
        if request.int8 and not cache.spec.supports_int8:
            raise TransferRefused("INVALID_ARGUMENT", "int8: this worker's KV cache cannot be sent as int8")
        ttl_s = offer_ttl(request.ttl_s)
        token = self.offers.add(request.request_id, request.block_ids, request.int8, ttl_s)
        nbytes = len(request.block_ids) * cache.transfer_bytes_per_block(request.int8)
        return worker_pb2.OfferKvResponse(token=token, nbytes=nbytes)

    async def read(self, token: str | None, blocks_per_chunk: int) -> AsyncIterator[bytes]:
        """The chunks of the offer `token` opens (TransferRefused before the first one)."""
        cache = self._cache()
        if blocks_per_chunk < 1:
            raise TransferRefused("INVALID_ARGUMENT", "blocks_per_chunk: must be >= 1")
        offer = self.offers.take(token)
        log.debug("a peer reads the KV of %s: %d blocks (int8 %s)", offer.request_id, len(offer.block_ids), offer.int8)
        return self._chunks(cache, offer, blocks_per_chunk)

    async def _chunks(self, cache: KVBlocks, offer: Offer, per_chunk: int) -> AsyncIterator[bytes]:
        ids = offer.block_ids
        for first, n in chunk_spans(ids, per_chunk):
            data = await self.runner.call_inline(self._export, cache, ids[first : first + n], offer.int8)
            yield encode_chunk(first, n, offer.int8, data)

    # -- decode side -------------------------------------------------------------------------

    async def pull(self, request: worker_pb2.PullKvRequest, timeout_s: float | None) -> worker_pb2.PullKvResponse:
        cache = self._cache()
        dst = list(request.block_ids)
        check_block_ids(dst, cache.num_gpu_blocks, "block_ids")
        self._check_unowned(dst)
        if not request.peer_address:
            raise TransferRefused("INVALID_ARGUMENT", "peer_address: the prefill worker's host:port is required")
        if not request.token:
            raise TransferRefused("INVALID_ARGUMENT", "token: the token OfferKv answered is required")
        per_chunk = request.blocks_per_chunk or default_blocks_per_chunk(cache.spec.bytes_per_block)
        read_kv = self._channel(request.peer_address).unary_stream(
            READ_KV_METHOD,
            request_serializer=worker_pb2.ReadKvRequest.SerializeToString,
            response_deserializer=parse_chunk,
        )
        metadata = (*self.peer_security.metadata, (TOKEN_KEY, request.token))
        start = time.perf_counter()
        nbytes = written = 0
        fence = object()
        for b in dst:
            self._writers[b] = fence
        call = read_kv(worker_pb2.ReadKvRequest(blocks_per_chunk=per_chunk), metadata=metadata, timeout=timeout_s)
        try:
            async for chunk in call:
                part = dst[chunk.first : chunk.first + chunk.num_blocks]
                if chunk.first != written or len(part) != chunk.num_blocks:
                    raise TransferRefused(
                        "DATA_LOSS",
                        f"the peer sent blocks {chunk.first}..+{chunk.num_blocks}, expected {written} of {len(dst)}",
                    )
                rows = _rows(chunk.data, chunk.num_blocks)
                await self.runner.call_inline(self._write, cache, part, rows, chunk.int8, fence)
                written += chunk.num_blocks
                nbytes += len(chunk.data)
        except grpc.aio.AioRpcError as exc:
            raise TransferRefused(
                "UNAVAILABLE", f"reading the KV from {request.peer_address} failed: {exc.code().name}: {exc.details()}"
            ) from exc
        finally:
            call.cancel()  # a no-op once the stream ended; else the peer stops reading the cache
            for b in dst:
                if self._writers.get(b) is fence:
                    del self._writers[b]
        if written != len(dst):
            raise TransferRefused("DATA_LOSS", f"the peer sent {written} blocks, block_ids has {len(dst)}")
        return worker_pb2.PullKvResponse(num_blocks=written, nbytes=nbytes, transfer_s=time.perf_counter() - start)

    def _export(self, cache: KVBlocks, ids: Sequence[int], int8: bool) -> bytes:
        self._check_same_cache(cache)
        return cache.export_blocks(ids, int8)

    def _check_same_cache(self, cache: KVBlocks) -> None:
        # NOTE: a Warmup between two chunks (the lease holder starting over) builds a new
        # cache; reading on would send the new session's KV to the old session's peer, and
        # writing on would put the old session's KV into the new one's blocks.
        if self._engine.cache is not cache:
            raise TransferRefused("ABORTED", "the worker was warmed up again during the transfer")

    def _write(self, cache: KVBlocks, dst: list[int], rows: torch.Tensor, int8: bool, fence: object) -> None:
        # NOTE: checked again per chunk, under the engine's lock: a step between two chunks
        # may have admitted a request (a diverged scheduler); never overwrite its KV.
        self._check_same_cache(cache)
        self._check_unowned(dst)
        if any(self._writers.get(b) is not fence for b in dst):
            raise TransferRefused("ABORTED", "a later transfer into these blocks superseded this one")
        try:
            cache.import_blocks(dst, rows, int8)
        except ValueError as exc:
            raise TransferRefused("DATA_LOSS", f"the peer's KV does not fit this worker's cache: {exc}") from exc

    def _check_unowned(self, dst: Sequence[int]) -> None:
        holders = self._engine.book.gpu_holders
        owned = [b for b in dst if holders.get(b)]
        if owned:
            owner = next(iter(holders[owned[0]]))
            raise TransferRefused(
                "ABORTED", f"block_ids: block {owned[0]} belongs to request {owner!r}, which this worker holds"
            )

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self.peer_security.channel(address, KEEPALIVE.channel_options())
            self._channels[address] = channel
        return channel

    def reset(self) -> None:
        """A Warmup: the cache is new, so every offer of the old one lapses."""
        self.offers.clear()
        self._writers.clear()
