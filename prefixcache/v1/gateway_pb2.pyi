from prefixcache.v1 import compute_service_pb2 as _compute_service_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoutePreviewRequest(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: _compute_service_pb2.GenerateRequest
    def __init__(self, request: _Optional[_Union[_compute_service_pb2.GenerateRequest, _Mapping]] = ...) -> None: ...

class WorkerScore(_message.Message):
    __slots__ = ("worker", "address", "device_tokens", "host_tokens", "remote_tokens", "in_flight", "queued_prefill_tokens", "score", "staleness_s", "eligible")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_S_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    worker: str
    address: str
    device_tokens: int
    host_tokens: int
    remote_tokens: int
    in_flight: int
    queued_prefill_tokens: int
    score: float
    staleness_s: float
    eligible: bool
    def __init__(self, worker: _Optional[str] = ..., address: _Optional[str] = ..., device_tokens: _Optional[int] = ..., host_tokens: _Optional[int] = ..., remote_tokens: _Optional[int] = ..., in_flight: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., score: _Optional[float] = ..., staleness_s: _Optional[float] = ..., eligible: _Optional[bool] = ...) -> None: ...

class RoutePreviewResponse(_message.Message):
    __slots__ = ("worker", "policy", "reason", "prompt_tokens", "candidates")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    worker: str
    policy: str
    reason: str
    prompt_tokens: int
    candidates: _containers.RepeatedCompositeFieldContainer[WorkerScore]
    def __init__(self, worker: _Optional[str] = ..., policy: _Optional[str] = ..., reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., candidates: _Optional[_Iterable[_Union[WorkerScore, _Mapping]]] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker", "address", "cache_address", "epoch", "last_seq", "device_pages", "host_pages", "staleness_s", "in_flight")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    STALENESS_S_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    worker: str
    address: str
    cache_address: str
    epoch: int
    last_seq: int
    device_pages: int
    host_pages: int
    staleness_s: float
    in_flight: int
    def __init__(self, worker: _Optional[str] = ..., address: _Optional[str] = ..., cache_address: _Optional[str] = ..., epoch: _Optional[int] = ..., last_seq: _Optional[int] = ..., device_pages: _Optional[int] = ..., host_pages: _Optional[int] = ..., staleness_s: _Optional[float] = ..., in_flight: _Optional[int] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...
