"""The asyncio client of the PredictorService, as the scheduler's intake uses it.

    client = PredictorClient("127.0.0.1:50071")
    pred = await client.predict(request_id, text_or_ids, model, max_tokens, timeout_s=0.005)
        -> LengthPrediction, or None on timeout or any error (never raises into the caller;
           the caller falls back to its own value and says so; `on_failure(reason)` hears why:
           timeout, unavailable, invalid_answer or error)
    client.observe(request_id, text_or_ids, model, true_tokens, finished_naturally)
        -> returns at once; the call runs in a background task (at most `max_pending` at a
           time, further ones dropped and counted), its errors logged at debug level

Channel options come from sluice.common.grpc_server (both ends agree on limits and keepalive);
TLS and the API key from a ClientSecurity, as every Sluice client dials.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc

from sluice.common.grpc_server import CHANNEL_OPTIONS
from sluice.common.security import PLAINTEXT, ClientSecurity
from sluice.contract.length_prediction import LengthPrediction
from sluice.v1 import common_pb2, predictor_pb2, predictor_pb2_grpc

log = logging.getLogger("sluice.predictor_client")

_SOURCES = {
    predictor_pb2.PREDICTION_SOURCE_CACHE: "cache",
    predictor_pb2.PREDICTION_SOURCE_RETRIEVAL: "retrieval",
    predictor_pb2.PREDICTION_SOURCE_HEAD: "head",
    predictor_pb2.PREDICTION_SOURCE_FALLBACK: "fallback",
    predictor_pb2.PREDICTION_SOURCE_BLEND: "blend",
}


def _with_prompt(msg: predictor_pb2.PredictRequest | predictor_pb2.ObserveRequest, prompt: str | Sequence[int]) -> None:
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.CopyFrom(common_pb2.TokenIds(ids=list(prompt)))


def from_proto(msg: predictor_pb2.PredictResponse) -> LengthPrediction:
    quantiles = tuple((q.level, int(q.tokens)) for q in msg.quantiles)
    return LengthPrediction(
        int(msg.predicted_output_tokens),
        quantiles,
        _SOURCES.get(msg.source, "unspecified"),
        msg.predictor_version,
        msg.latency_s,
    )


def failure_reason(exc: BaseException) -> str:
    """Why a prediction failed, as the scheduler's fallback counter labels it."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ValueError):
        return "invalid_answer"
    if isinstance(exc, grpc.aio.AioRpcError):
        code = exc.code()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return "timeout"
        if code is grpc.StatusCode.UNAVAILABLE:
            return "unavailable"
    if isinstance(exc, OSError):
        return "unavailable"
    return "error"


class PredictorClient:
    def __init__(
        self,
        target: str,
        *,
        max_pending: int = 1024,
        observe_timeout_s: float = 2.0,
        security: ClientSecurity = PLAINTEXT,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.target = target
        self.max_pending = max_pending
        self.observe_timeout_s = observe_timeout_s
        self.on_failure = on_failure
        self._metadata = security.metadata or None
        self._channel = security.channel(target, options=CHANNEL_OPTIONS)
        self._stub = predictor_pb2_grpc.PredictorServiceStub(self._channel)
        self._pending: set[asyncio.Task[None]] = set()
        self.num_failed = 0  # predictions that returned None
        self.num_dropped_observations = 0

    async def __aenter__(self) -> PredictorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def predict(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        model: str = "",
        max_tokens: int = 0,
        timeout_s: float = 0.005,
    ) -> LengthPrediction | None:
        msg = predictor_pb2.PredictRequest(request_id=request_id, model=model, max_tokens=max_tokens)
        _with_prompt(msg, prompt)
        try:
            return from_proto(await self._stub.Predict(msg, timeout=timeout_s, metadata=self._metadata))
        except (TimeoutError, grpc.aio.AioRpcError, ValueError, OSError) as exc:
            self.num_failed += 1
            log.debug("prediction of %s failed: %s", request_id, exc)
            if self.on_failure is not None:
                self.on_failure(failure_reason(exc))
            return None

    async def predict_batch(
        self, requests: Sequence[tuple[str, str | Sequence[int], str, int]], timeout_s: float = 1.0
    ) -> list[LengthPrediction] | None:
        """(request_id, prompt, model, max_tokens) each; None on timeout or error."""
        msgs = []
        for request_id, prompt, model, max_tokens in requests:
            msg = predictor_pb2.PredictRequest(request_id=request_id, model=model, max_tokens=max_tokens)
            _with_prompt(msg, prompt)
            msgs.append(msg)
        try:
            batch = predictor_pb2.PredictBatchRequest(requests=msgs)
            reply = await self._stub.PredictBatch(batch, timeout=timeout_s, metadata=self._metadata)
        except (TimeoutError, grpc.aio.AioRpcError, ValueError, OSError) as exc:
            self.num_failed += 1
            log.debug("batch prediction failed: %s", exc)
            return None
        return [from_proto(r) for r in reply.responses]

    def observe(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        model: str,
        true_tokens: int,
        finished_naturally: bool = True,
    ) -> None:
        """Reports a finished request in the background; never blocks, never raises."""
        if len(self._pending) >= self.max_pending:
            self.num_dropped_observations += 1
            return
        msg = predictor_pb2.ObserveRequest(
            request_id=request_id, model=model, true_output_tokens=true_tokens, finished_naturally=finished_naturally
        )
        _with_prompt(msg, prompt)
        task = asyncio.get_running_loop().create_task(self._observe(msg))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _observe(self, msg: predictor_pb2.ObserveRequest) -> None:
        try:
            await self._stub.Observe(msg, timeout=self.observe_timeout_s, metadata=self._metadata)
        except (TimeoutError, grpc.aio.AioRpcError, OSError) as exc:
            log.debug("observe of %s failed: %s", msg.request_id, exc)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Waits for the observations in flight (tests, shutdown)."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout_s)

    async def close(self) -> None:
        await self.drain(1.0)
        await self._channel.close()
