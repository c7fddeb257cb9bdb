from sluice.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling_params", "slo", "priority", "tenant", "predicted_output_tokens", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    sampling_params: _common_pb2.SamplingParams
    slo: _common_pb2.SloSpec
    priority: int
    tenant: str
    predicted_output_tokens: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., slo: _Optional[_Union[_common_pb2.SloSpec, _Mapping]] = ..., priority: _Optional[int] = ..., tenant: _Optional[str] = ..., predicted_output_tokens: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "timings", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.RequestTimings
    message: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.RequestTimings, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_ids",)
    ABORTED_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerDescription(_message.Message):
    __slots__ = ("worker_id", "address", "healthy", "num_gpu_blocks", "num_cpu_blocks", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    healthy: bool
    num_gpu_blocks: int
    num_cpu_blocks: int
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., role: _Optional[str] = ...) -> None: ...

class GetServerInfoResponse(_message.Message):
    __slots__ = ("version", "policy", "router", "model", "max_model_len", "max_waiting", "block_size", "workers", "max_prompt_tokens", "default_max_tokens", "max_prompt_bytes", "vocab_size")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    version: str
    policy: str
    router: str
    model: str
    max_model_len: int
    max_waiting: int
    block_size: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerDescription]
    max_prompt_tokens: int
    default_max_tokens: int
    max_prompt_bytes: int
    vocab_size: int
    def __init__(self, version: _Optional[str] = ..., policy: _Optional[str] = ..., router: _Optional[str] = ..., model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., max_waiting: _Optional[int] = ..., block_size: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerDescription, _Mapping]]] = ..., max_prompt_tokens: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., max_prompt_bytes: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "healthy", "num_running", "num_waiting", "num_swapped", "gpu_blocks_total", "gpu_blocks_used", "cpu_blocks_total", "cpu_blocks_used", "num_steps")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    healthy: bool
    num_running: int
    num_waiting: int
    num_swapped: int
    gpu_blocks_total: int
    gpu_blocks_used: int
    cpu_blocks_total: int
    cpu_blocks_used: int
    num_steps: int
    def __init__(self, worker_id: _Optional[str] = ..., healthy: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_swapped: _Optional[int] = ..., gpu_blocks_total: _Optional[int] = ..., gpu_blocks_used: _Optional[int] = ..., cpu_blocks_total: _Optional[int] = ..., cpu_blocks_used: _Optional[int] = ..., num_steps: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_swapped", "num_finished", "num_rejected", "num_preemptions", "throughput_tok_s", "slo_attainment_req", "workers")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_TOK_S_FIELD_NUMBER: _ClassVar[int]
    SLO_ATTAINMENT_REQ_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_swapped: int
    num_finished: int
    num_rejected: int
    num_preemptions: int
    throughput_tok_s: float
    slo_attainment_req: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_rejected: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., throughput_tok_s: _Optional[float] = ..., slo_attainment_req: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ...) -> None: ...
