"""The gRPC PredictorService (protos/sluice/v1/predictor.proto): Predict, PredictBatch, Observe.

    PredictRequest --validate (INVALID_ARGUMENT naming the field)--> Query
        --PredictorEngine.predict--> LengthPrediction --to_proto--> PredictResponse
    ObserveRequest --validate--> PredictorEngine.observe --> ObserveResponse

Health and reflection come from sluice.common.grpc_server.GrpcServer: readiness
(`sluice.v1.PredictorService`) turns SERVING once the model is loaded and the engine started.
A bad request is answered alone; it never fails the other requests of a batch call's peers.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import grpc

from predictor_service.engine import EngineConfig, PredictorEngine, Query
from predictor_service.predictor import LengthPredictor
from sluice.common.grpc_server import GrpcServer
from sluice.common.security import ServerSecurity
from sluice.contract.length_prediction import (
    SOURCE_BLEND,
    SOURCE_CACHE,
    SOURCE_FALLBACK,
    SOURCE_HEAD,
    SOURCE_RETRIEVAL,
    LengthPrediction,
)
from sluice.v1 import predictor_pb2, predictor_pb2_grpc

log = logging.getLogger("sluice.predictor")
SERVICE_NAME = "sluice.v1.PredictorService"
MAX_BATCH_REQUESTS = 1024
MAX_PROMPT_CHARS = 1_000_000

SOURCE_TO_PROTO = {
    SOURCE_CACHE: predictor_pb2.PREDICTION_SOURCE_CACHE,
    SOURCE_RETRIEVAL: predictor_pb2.PREDICTION_SOURCE_RETRIEVAL,
    SOURCE_HEAD: predictor_pb2.PREDICTION_SOURCE_HEAD,
    SOURCE_FALLBACK: predictor_pb2.PREDICTION_SOURCE_FALLBACK,
    SOURCE_BLEND: predictor_pb2.PREDICTION_SOURCE_BLEND,
}


class InvalidRequest(ValueError):
    """Bad input; the message names the field."""


def _prompt(
    msg: predictor_pb2.PredictRequest | predictor_pb2.ObserveRequest, field: str, vocab: int
) -> str | tuple[int, ...]:
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest(f"{field}: give a prompt as text or token_ids")
    if kind == "text":
        if not msg.text.strip():
            raise InvalidRequest(f"{field}text: the prompt is empty")
        if len(msg.text) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"{field}text: {len(msg.text)} characters, at most {MAX_PROMPT_CHARS}")
        return msg.text
    ids = tuple(msg.token_ids.ids)
    if not ids:
        raise InvalidRequest(f"{field}token_ids: the prompt is empty")
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest(f"{field}token_ids: id {bad} is outside the served tokenizer's vocabulary of {vocab}")
    return ids


def to_query(msg: predictor_pb2.PredictRequest, vocab: int, field: str = "") -> Query:
    return Query(msg.request_id, _prompt(msg, field, vocab), msg.model, int(msg.max_tokens))


def to_proto(request_id: str, p: LengthPrediction) -> predictor_pb2.PredictResponse:
    return predictor_pb2.PredictResponse(
        request_id=request_id,
        predicted_output_tokens=p.tokens,
        source=SOURCE_TO_PROTO.get(p.source, predictor_pb2.PREDICTION_SOURCE_UNSPECIFIED),
        predictor_version=p.predictor_version,
        latency_s=p.latency_s,
        quantiles=[predictor_pb2.Quantile(level=q, tokens=v) for q, v in p.quantiles],
    )


class PredictorServicer(predictor_pb2_grpc.PredictorServiceServicer):
    def __init__(self, engine: PredictorEngine) -> None:
        self.engine = engine
        self._vocab = engine.vocab_size()

    async def _answer(self, queries: Sequence[Query], context: grpc.aio.ServicerContext) -> list[LengthPrediction]:
        try:
            return await self.engine.predict(queries)
        except Exception as exc:  # a model failure is reported, never crashes the server
            log.exception("prediction failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"prediction failed: {exc}")
            raise

    async def Predict(self, request: predictor_pb2.PredictRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            query = to_query(request, self._vocab)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        (pred,) = await self._answer([query], context)
        return to_proto(request.request_id, pred)

    async def PredictBatch(self, request: predictor_pb2.PredictBatchRequest, context: grpc.aio.ServicerContext) -> Any:
        if len(request.requests) > MAX_BATCH_REQUESTS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"requests: {len(request.requests)} given, at most {MAX_BATCH_REQUESTS}",
            )
        try:
            queries = [to_query(r, self._vocab, f"requests[{i}].") for i, r in enumerate(request.requests)]
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        preds = await self._answer(queries, context)
        return predictor_pb2.PredictBatchResponse(
            responses=[to_proto(r.request_id, p) for r, p in zip(request.requests, preds, strict=True)]
        )

    async def Observe(self, request: predictor_pb2.ObserveRequest, context: grpc.aio.ServicerContext) -> Any:
        try:
            query = Query(request.request_id, _prompt(request, "", self._vocab), request.model)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if request.true_output_tokens == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "true_output_tokens: must be at least 1")
        accepted = await self.engine.observe(query, int(request.true_output_tokens), request.finished_naturally)
        return predictor_pb2.ObserveResponse(accepted=accepted, history_size=len(self.engine.predictor.history))


async def start_server(
    engine: PredictorEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    security: ServerSecurity | None = None,
    health_port: int | None = None,
) -> GrpcServer:
    """Starts the engine and a GrpcServer with the servicer (TLS and API keys as `security`
    says, as every Sluice server); readiness SERVING when both run."""
    await engine.start()
    servicer = PredictorServicer(engine)
    server = GrpcServer.build(
        SERVICE_NAME,
        lambda s: predictor_pb2_grpc.add_PredictorServiceServicer_to_server(servicer, s),
        host,
        port,
        security=security,
        health_port=health_port,
    )
    await server.start(ready=True)
    return server


def build_engine(
    model_dir: str | None,
    config: EngineConfig,
    *,
    threads: int = 1,
    device: str = "auto",
    precision: str | None = None,
) -> PredictorEngine:
    predictor = LengthPredictor(model_dir, threads=threads, device=device, precision=precision)
    log.info("predictor %s", predictor.describe())
    return PredictorEngine(predictor, config)
