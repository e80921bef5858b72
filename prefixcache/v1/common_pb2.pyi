from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_UNSPECIFIED: _ClassVar[Medium]
    MEDIUM_DEVICE: _ClassVar[Medium]
    MEDIUM_HOST: _ClassVar[Medium]
    MEDIUM_REMOTE: _ClassVar[Medium]
MEDIUM_UNSPECIFIED: Medium
MEDIUM_DEVICE: Medium
MEDIUM_HOST: Medium
MEDIUM_REMOTE: Medium

class Namespace(_message.Message):
    __slots__ = ("model_id", "adapter", "salt")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    adapter: str
    salt: str
    def __init__(self, model_id: _Optional[str] = ..., adapter: _Optional[str] = ..., salt: _Optional[str] = ...) -> None: ...

class CopyOp(_message.Message):
    __slots__ = ("src_medium", "src_page", "dst_medium", "dst_page", "page_hash", "mamba_slot")
    SRC_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGE_FIELD_NUMBER: _ClassVar[int]
    DST_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SLOT_FIELD_NUMBER: _ClassVar[int]
    src_medium: Medium
    src_page: int
    dst_medium: Medium
    dst_page: int
    page_hash: bytes
    mamba_slot: int
    def __init__(self, src_medium: _Optional[_Union[Medium, str]] = ..., src_page: _Optional[int] = ..., dst_medium: _Optional[_Union[Medium, str]] = ..., dst_page: _Optional[int] = ..., page_hash: _Optional[bytes] = ..., mamba_slot: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("waiting_requests", "running_requests", "queued_prefill_tokens", "timestamp")
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    waiting_requests: int
    running_requests: int
    queued_prefill_tokens: int
    timestamp: float
    def __init__(self, waiting_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., timestamp: _Optional[float] = ...) -> None: ...
