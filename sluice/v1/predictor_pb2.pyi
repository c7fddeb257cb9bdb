from sluice.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PredictionSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREDICTION_SOURCE_UNSPECIFIED: _ClassVar[PredictionSource]
    PREDICTION_SOURCE_CACHE: _ClassVar[PredictionSource]
    PREDICTION_SOURCE_RETRIEVAL: _ClassVar[PredictionSource]
    PREDICTION_SOURCE_HEAD: _ClassVar[PredictionSource]
    PREDICTION_SOURCE_FALLBACK: _ClassVar[PredictionSource]
    PREDICTION_SOURCE_BLEND: _ClassVar[PredictionSource]
PREDICTION_SOURCE_UNSPECIFIED: PredictionSource
PREDICTION_SOURCE_CACHE: PredictionSource
PREDICTION_SOURCE_RETRIEVAL: PredictionSource
PREDICTION_SOURCE_HEAD: PredictionSource
PREDICTION_SOURCE_FALLBACK: PredictionSource
PREDICTION_SOURCE_BLEND: PredictionSource

class Quantile(_message.Message):
    __slots__ = ("level", "tokens")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    level: float
    tokens: int
    def __init__(self, level: _Optional[float] = ..., tokens: _Optional[int] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "model", "max_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    model: str
    max_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., model: _Optional[str] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("request_id", "predicted_output_tokens", "source", "predictor_version", "latency_s", "quantiles")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    QUANTILES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    predicted_output_tokens: int
    source: PredictionSource
    predictor_version: str
    latency_s: float
    quantiles: _containers.RepeatedCompositeFieldContainer[Quantile]
    def __init__(self, request_id: _Optional[str] = ..., predicted_output_tokens: _Optional[int] = ..., source: _Optional[_Union[PredictionSource, str]] = ..., predictor_version: _Optional[str] = ..., latency_s: _Optional[float] = ..., quantiles: _Optional[_Iterable[_Union[Quantile, _Mapping]]] = ...) -> None: ...

class PredictBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[PredictRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[PredictRequest, _Mapping]]] = ...) -> None: ...

class PredictBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[PredictResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[PredictResponse, _Mapping]]] = ...) -> None: ...

class ObserveRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "model", "true_output_tokens", "finished_naturally")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRUE_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_NATURALLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    model: str
    true_output_tokens: int
    finished_naturally: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., model: _Optional[str] = ..., true_output_tokens: _Optional[int] = ..., finished_naturally: _Optional[bool] = ...) -> None: ...

class ObserveResponse(_message.Message):
    __slots__ = ("accepted", "history_size")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HISTORY_SIZE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    history_size: int
    def __init__(self, accepted: _Optional[bool] = ..., history_size: _Optional[int] = ...) -> None: ...
