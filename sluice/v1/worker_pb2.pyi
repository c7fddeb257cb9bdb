from sluice.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_MIXED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class KvMoveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_MOVE_KIND_UNSPECIFIED: _ClassVar[KvMoveKind]
    KV_MOVE_KIND_SWAP_OUT: _ClassVar[KvMoveKind]
    KV_MOVE_KIND_SWAP_IN: _ClassVar[KvMoveKind]
    KV_MOVE_KIND_COPY: _ClassVar[KvMoveKind]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_MIXED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
KV_MOVE_KIND_UNSPECIFIED: KvMoveKind
KV_MOVE_KIND_SWAP_OUT: KvMoveKind
KV_MOVE_KIND_SWAP_IN: KvMoveKind
KV_MOVE_KIND_COPY: KvMoveKind

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerCapabilities(_message.Message):
    __slots__ = ("chunked_prefill", "swap", "int8_swap", "async_swap", "role", "sampling")
    CHUNKED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    INT8_SWAP_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SWAP_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    chunked_prefill: bool
    swap: bool
    int8_swap: bool
    async_swap: bool
    role: WorkerRole
    sampling: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, chunked_prefill: _Optional[bool] = ..., swap: _Optional[bool] = ..., int8_swap: _Optional[bool] = ..., async_swap: _Optional[bool] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., sampling: _Optional[_Iterable[str]] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("worker_id", "model", "model_family", "dtype", "device", "block_size", "max_model_len", "vocab_size", "eos_token_ids", "capabilities", "version", "warmed_up", "model_dimensions", "hardware")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FAMILY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WARMED_UP_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    model_family: str
    dtype: str
    device: str
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    capabilities: WorkerCapabilities
    version: str
    warmed_up: bool
    model_dimensions: ModelDimensions
    hardware: HardwareDescription
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., model_family: _Optional[str] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., capabilities: _Optional[_Union[WorkerCapabilities, _Mapping]] = ..., version: _Optional[str] = ..., warmed_up: _Optional[bool] = ..., model_dimensions: _Optional[_Union[ModelDimensions, _Mapping]] = ..., hardware: _Optional[_Union[HardwareDescription, _Mapping]] = ...) -> None: ...

class ModelDimensions(_message.Message):
    __slots__ = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size", "gated_mlp", "dtype_bytes")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    GATED_MLP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    gated_mlp: bool
    dtype_bytes: int
    def __init__(self, num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., gated_mlp: _Optional[bool] = ..., dtype_bytes: _Optional[int] = ...) -> None: ...

class HardwareDescription(_message.Message):
    __slots__ = ("preset", "name", "peak_flops", "memory_bandwidth", "memory_bytes", "host_link_bandwidth")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PEAK_FLOPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_LINK_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    preset: str
    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_bytes: float
    host_link_bandwidth: float
    def __init__(self, preset: _Optional[str] = ..., name: _Optional[str] = ..., peak_flops: _Optional[float] = ..., memory_bandwidth: _Optional[float] = ..., memory_bytes: _Optional[float] = ..., host_link_bandwidth: _Optional[float] = ...) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("gpu_memory_utilization", "swap_space_gib", "max_num_batched_tokens", "max_num_seqs", "num_gpu_blocks_override", "role")
    GPU_MEMORY_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    SWAP_SPACE_GIB_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    gpu_memory_utilization: float
    swap_space_gib: float
    max_num_batched_tokens: int
    max_num_seqs: int
    num_gpu_blocks_override: int
    role: WorkerRole
    def __init__(self, gpu_memory_utilization: _Optional[float] = ..., swap_space_gib: _Optional[float] = ..., max_num_batched_tokens: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., num_gpu_blocks_override: _Optional[int] = ..., role: _Optional[_Union[WorkerRole, str]] = ...) -> None: ...

class WarmupResponse(_message.Message):
    __slots__ = ("num_gpu_blocks", "num_cpu_blocks", "block_size", "bytes_per_block", "warmup_s", "peak_activation_bytes", "session_id", "lease_ttl_s")
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    WARMUP_S_FIELD_NUMBER: _ClassVar[int]
    PEAK_ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    bytes_per_block: int
    warmup_s: float
    peak_activation_bytes: int
    session_id: str
    lease_ttl_s: float
    def __init__(self, num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., bytes_per_block: _Optional[int] = ..., warmup_s: _Optional[float] = ..., peak_activation_bytes: _Optional[int] = ..., session_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "block_ids", "num_computed_tokens", "num_output_tokens", "traceparent")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_output_tokens: int
    traceparent: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class BlockIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CachedRequests(_message.Message):
    __slots__ = ("request_ids", "new_block_ids", "resumed", "num_computed_tokens")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    new_block_ids: _containers.RepeatedCompositeFieldContainer[BlockIds]
    resumed: _containers.RepeatedScalarFieldContainer[bool]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., new_block_ids: _Optional[_Iterable[_Union[BlockIds, _Mapping]]] = ..., resumed: _Optional[_Iterable[bool]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class KvMove(_message.Message):
    __slots__ = ("kind", "request_id", "src_block_ids", "dst_block_ids", "int8")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    INT8_FIELD_NUMBER: _ClassVar[int]
    kind: KvMoveKind
    request_id: str
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    int8: bool
    def __init__(self, kind: _Optional[_Union[KvMoveKind, str]] = ..., request_id: _Optional[str] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., int8: _Optional[bool] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "scheduled_ids", "num_scheduled_tokens", "sample", "release_ids", "kv_moves", "metadata", "same_scheduled_ids", "follows_step_id")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_MOVES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SAME_SCHEDULED_IDS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWS_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: CachedRequests
    scheduled_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[bool]
    release_ids: _containers.RepeatedScalarFieldContainer[str]
    kv_moves: _containers.RepeatedCompositeFieldContainer[KvMove]
    metadata: _containers.ScalarMap[str, str]
    same_scheduled_ids: bool
    follows_step_id: int
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Union[CachedRequests, _Mapping]] = ..., scheduled_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[bool]] = ..., release_ids: _Optional[_Iterable[str]] = ..., kv_moves: _Optional[_Iterable[_Union[KvMove, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., same_scheduled_ids: _Optional[bool] = ..., follows_step_id: _Optional[int] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("code", "message", "request_id")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    request_id: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class StepTimings(_message.Message):
    __slots__ = ("prepare_s", "forward_s", "sample_s", "swap_s", "total_s")
    PREPARE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_S_FIELD_NUMBER: _ClassVar[int]
    SWAP_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    prepare_s: float
    forward_s: float
    sample_s: float
    swap_s: float
    total_s: float
    def __init__(self, prepare_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., sample_s: _Optional[float] = ..., swap_s: _Optional[float] = ..., total_s: _Optional[float] = ...) -> None: ...

class ExecuteResponse(_message.Message):
    __slots__ = ("step_id", "sampled_ids", "token_ids", "timings", "error", "swap_bytes")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SWAP_BYTES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    timings: StepTimings
    error: StepError
    swap_bytes: int
    def __init__(self, step_id: _Optional[int] = ..., sampled_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., timings: _Optional[_Union[StepTimings, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., swap_bytes: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids", "end_lease")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    END_LEASE_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    end_lease: bool
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., end_lease: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_ids",)
    RELEASED_IDS_FIELD_NUMBER: _ClassVar[int]
    released_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, released_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("serving", "message", "num_requests", "leased", "lease_holder")
    SERVING_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    LEASE_HOLDER_FIELD_NUMBER: _ClassVar[int]
    serving: bool
    message: str
    num_requests: int
    leased: bool
    lease_holder: bool
    def __init__(self, serving: _Optional[bool] = ..., message: _Optional[str] = ..., num_requests: _Optional[int] = ..., leased: _Optional[bool] = ..., lease_holder: _Optional[bool] = ...) -> None: ...

class OfferKvRequest(_message.Message):
    __slots__ = ("request_id", "block_ids", "int8", "ttl_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    INT8_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    int8: bool
    ttl_s: float
    def __init__(self, request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., int8: _Optional[bool] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class OfferKvResponse(_message.Message):
    __slots__ = ("token", "nbytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    token: str
    nbytes: int
    def __init__(self, token: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class PullKvRequest(_message.Message):
    __slots__ = ("peer_address", "token", "block_ids", "blocks_per_chunk")
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    peer_address: str
    token: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    blocks_per_chunk: int
    def __init__(self, peer_address: _Optional[str] = ..., token: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., blocks_per_chunk: _Optional[int] = ...) -> None: ...

class PullKvResponse(_message.Message):
    __slots__ = ("num_blocks", "nbytes", "transfer_s")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    nbytes: int
    transfer_s: float
    def __init__(self, num_blocks: _Optional[int] = ..., nbytes: _Optional[int] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class ReadKvRequest(_message.Message):
    __slots__ = ("blocks_per_chunk",)
    BLOCKS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    blocks_per_chunk: int
    def __init__(self, blocks_per_chunk: _Optional[int] = ...) -> None: ...

class ReadKvResponse(_message.Message):
    __slots__ = ("first", "num_blocks", "int8", "data")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INT8_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    first: int
    num_blocks: int
    int8: bool
    data: bytes
    def __init__(self, first: _Optional[int] = ..., num_blocks: _Optional[int] = ..., int8: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...
