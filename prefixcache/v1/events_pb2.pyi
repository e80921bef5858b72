from prefixcache.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "model_id", "adapter", "medium", "packed_block_hashes")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    model_id: str
    adapter: str
    medium: _common_pb2.Medium
    packed_block_hashes: bytes
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., model_id: _Optional[str] = ..., adapter: _Optional[str] = ..., medium: _Optional[_Union[_common_pb2.Medium, str]] = ..., packed_block_hashes: _Optional[bytes] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "packed_block_hashes")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    PACKED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: _common_pb2.Medium
    packed_block_hashes: bytes
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[_Union[_common_pb2.Medium, str]] = ..., packed_block_hashes: _Optional[bytes] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("pool_id", "epoch", "seq", "timestamp", "events", "snapshot", "snapshot_end")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_END_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    seq: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    snapshot: bool
    snapshot_end: bool
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., snapshot_end: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("pool_id", "epoch", "head_seq", "timestamp", "load")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    head_seq: int
    timestamp: float
    load: _common_pb2.LoadReport
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., head_seq: _Optional[int] = ..., timestamp: _Optional[float] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ...) -> None: ...
