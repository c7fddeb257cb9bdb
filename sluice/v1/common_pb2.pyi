from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SloClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLO_CLASS_UNSPECIFIED: _ClassVar[SloClass]
    SLO_CLASS_ONLINE: _ClassVar[SloClass]
    SLO_CLASS_OFFLINE: _ClassVar[SloClass]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TIMEOUT: _ClassVar[FinishReason]
    FINISH_REASON_REJECTED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_UNSPECIFIED: _ClassVar[KvTier]
    KV_TIER_GPU: _ClassVar[KvTier]
    KV_TIER_CPU: _ClassVar[KvTier]

class PreemptionMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREEMPTION_MODE_UNSPECIFIED: _ClassVar[PreemptionMode]
    PREEMPTION_MODE_RECOMPUTE: _ClassVar[PreemptionMode]
    PREEMPTION_MODE_SWAP: _ClassVar[PreemptionMode]
    PREEMPTION_MODE_KEEP: _ClassVar[PreemptionMode]
SLO_CLASS_UNSPECIFIED: SloClass
SLO_CLASS_ONLINE: SloClass
SLO_CLASS_OFFLINE: SloClass
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TIMEOUT: FinishReason
FINISH_REASON_REJECTED: FinishReason
FINISH_REASON_ERROR: FinishReason
KV_TIER_UNSPECIFIED: KvTier
KV_TIER_GPU: KvTier
KV_TIER_CPU: KvTier
PREEMPTION_MODE_UNSPECIFIED: PreemptionMode
PREEMPTION_MODE_RECOMPUTE: PreemptionMode
PREEMPTION_MODE_SWAP: PreemptionMode
PREEMPTION_MODE_KEEP: PreemptionMode

class SloSpec(_message.Message):
    __slots__ = ("ttft_ms", "tbt_ms", "jct_ms", "slo_class")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TBT_MS_FIELD_NUMBER: _ClassVar[int]
    JCT_MS_FIELD_NUMBER: _ClassVar[int]
    SLO_CLASS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    tbt_ms: float
    jct_ms: float
    slo_class: SloClass
    def __init__(self, ttft_ms: _Optional[float] = ..., tbt_ms: _Optional[float] = ..., jct_ms: _Optional[float] = ..., slo_class: _Optional[_Union[SloClass, str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "n", "skip_special_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    min_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    n: int
    skip_special_tokens: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., n: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class RequestTimings(_message.Message):
    __slots__ = ("queue_s", "ttft_s", "jct_s", "mean_tbt_s", "max_tbt_s", "num_preemptions", "slo_met")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    JCT_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_TBT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_TBT_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    SLO_MET_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    ttft_s: float
    jct_s: float
    mean_tbt_s: float
    max_tbt_s: float
    num_preemptions: int
    slo_met: bool
    def __init__(self, queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., jct_s: _Optional[float] = ..., mean_tbt_s: _Optional[float] = ..., max_tbt_s: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., slo_met: _Optional[bool] = ...) -> None: ...
