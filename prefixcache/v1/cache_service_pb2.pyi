from prefixcache.v1 import common_pb2 as _common_pb2
from prefixcache.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RemoteWritePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REMOTE_WRITE_POLICY_UNSPECIFIED: _ClassVar[RemoteWritePolicy]
    REMOTE_WRITE_POLICY_WRITE_THROUGH: _ClassVar[RemoteWritePolicy]
    REMOTE_WRITE_POLICY_WRITE_BACK: _ClassVar[RemoteWritePolicy]
    REMOTE_WRITE_POLICY_HOT: _ClassVar[RemoteWritePolicy]
REMOTE_WRITE_POLICY_UNSPECIFIED: RemoteWritePolicy
REMOTE_WRITE_POLICY_WRITE_THROUGH: RemoteWritePolicy
REMOTE_WRITE_POLICY_WRITE_BACK: RemoteWritePolicy
REMOTE_WRITE_POLICY_HOT: RemoteWritePolicy

class RegisterPoolRequest(_message.Message):
    __slots__ = ("pool_id", "epoch", "page_size", "device_pages", "host_pages", "mamba_slots", "model_id", "lease_ttl_s", "remote_write_policy", "remote_min_hits", "remote_lookup")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    REMOTE_WRITE_POLICY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_MIN_HITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_LOOKUP_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    page_size: int
    device_pages: int
    host_pages: int
    mamba_slots: int
    model_id: str
    lease_ttl_s: float
    remote_write_policy: RemoteWritePolicy
    remote_min_hits: int
    remote_lookup: bool
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., page_size: _Optional[int] = ..., device_pages: _Optional[int] = ..., host_pages: _Optional[int] = ..., mamba_slots: _Optional[int] = ..., model_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., remote_write_policy: _Optional[_Union[RemoteWritePolicy, str]] = ..., remote_min_hits: _Optional[int] = ..., remote_lookup: _Optional[bool] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("reset", "next_seq")
    RESET_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    next_seq: int
    def __init__(self, reset: _Optional[bool] = ..., next_seq: _Optional[int] = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("pool_id", "epoch")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class UnregisterPoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPoolsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("pool_id", "epoch", "page_size", "device_pages", "host_pages", "mamba_slots", "model_id", "head_seq")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    HEAD_SEQ_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    page_size: int
    device_pages: int
    host_pages: int
    mamba_slots: int
    model_id: str
    head_seq: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., page_size: _Optional[int] = ..., device_pages: _Optional[int] = ..., host_pages: _Optional[int] = ..., mamba_slots: _Optional[int] = ..., model_id: _Optional[str] = ..., head_seq: _Optional[int] = ...) -> None: ...

class ListPoolsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ...) -> None: ...

class MatchOp(_message.Message):
    __slots__ = ("request_id", "namespace", "token_ids", "lease_ttl_s", "is_resume", "skip_host_load", "packed_token_ids", "omit_page_hashes", "retain_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    IS_RESUME_FIELD_NUMBER: _ClassVar[int]
    SKIP_HOST_LOAD_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OMIT_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    RETAIN_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    namespace: _common_pb2.Namespace
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_ttl_s: float
    is_resume: bool
    skip_host_load: bool
    packed_token_ids: bytes
    omit_page_hashes: bool
    retain_s: float
    def __init__(self, request_id: _Optional[str] = ..., namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., lease_ttl_s: _Optional[float] = ..., is_resume: _Optional[bool] = ..., skip_host_load: _Optional[bool] = ..., packed_token_ids: _Optional[bytes] = ..., omit_page_hashes: _Optional[bool] = ..., retain_s: _Optional[float] = ...) -> None: ...

class MatchResult(_message.Message):
    __slots__ = ("request_id", "lease_id", "device_pages", "cached_tokens", "device_hit_tokens", "host_hit_tokens", "page_hashes", "mamba_slot", "unusable_pages", "remote_pages", "remote_page_hashes", "remote_hit_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SLOT_FIELD_NUMBER: _ClassVar[int]
    UNUSABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PAGES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    mamba_slot: int
    unusable_pages: int
    remote_pages: _containers.RepeatedScalarFieldContainer[int]
    remote_page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    remote_hit_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., device_pages: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., device_hit_tokens: _Optional[int] = ..., host_hit_tokens: _Optional[int] = ..., page_hashes: _Optional[_Iterable[bytes]] = ..., mamba_slot: _Optional[int] = ..., unusable_pages: _Optional[int] = ..., remote_pages: _Optional[_Iterable[int]] = ..., remote_page_hashes: _Optional[_Iterable[bytes]] = ..., remote_hit_tokens: _Optional[int] = ...) -> None: ...

class AllocateOp(_message.Message):
    __slots__ = ("lease_id", "num_pages")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    num_pages: int
    def __init__(self, lease_id: _Optional[str] = ..., num_pages: _Optional[int] = ...) -> None: ...

class AllocateResult(_message.Message):
    __slots__ = ("lease_id", "ok", "device_pages", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_PAGES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ok: bool
    device_pages: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., ok: _Optional[bool] = ..., device_pages: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class PublishOp(_message.Message):
    __slots__ = ("lease_id", "append_token_ids", "packed_append_token_ids", "computed_pages")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_APPEND_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    append_token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_append_token_ids: bytes
    computed_pages: int
    def __init__(self, lease_id: _Optional[str] = ..., append_token_ids: _Optional[_Iterable[int]] = ..., packed_append_token_ids: _Optional[bytes] = ..., computed_pages: _Optional[int] = ...) -> None: ...

class PageRemap(_message.Message):
    __slots__ = ("index", "old_page", "new_page")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OLD_PAGE_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    old_page: int
    new_page: int
    def __init__(self, index: _Optional[int] = ..., old_page: _Optional[int] = ..., new_page: _Optional[int] = ...) -> None: ...

class PublishResult(_message.Message):
    __slots__ = ("lease_id", "inserted_pages", "remaps")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INSERTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REMAPS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    inserted_pages: int
    remaps: _containers.RepeatedCompositeFieldContainer[PageRemap]
    def __init__(self, lease_id: _Optional[str] = ..., inserted_pages: _Optional[int] = ..., remaps: _Optional[_Iterable[_Union[PageRemap, _Mapping]]] = ...) -> None: ...

class CheckpointOp(_message.Message):
    __slots__ = ("lease_id", "page_index", "detach")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    page_index: int
    detach: bool
    def __init__(self, lease_id: _Optional[str] = ..., page_index: _Optional[int] = ..., detach: _Optional[bool] = ...) -> None: ...

class CheckpointResult(_message.Message):
    __slots__ = ("lease_id", "page_index", "ok", "slot", "already_present", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    page_index: int
    ok: bool
    slot: int
    already_present: bool
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., page_index: _Optional[int] = ..., ok: _Optional[bool] = ..., slot: _Optional[int] = ..., already_present: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseOp(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("pool_id", "epoch", "publishes", "checkpoints", "releases", "renew_lease_ids", "matches", "allocations", "load", "failed_remote_writes")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    RENEW_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    FAILED_REMOTE_WRITES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    publishes: _containers.RepeatedCompositeFieldContainer[PublishOp]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointOp]
    releases: _containers.RepeatedCompositeFieldContainer[ReleaseOp]
    renew_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    matches: _containers.RepeatedCompositeFieldContainer[MatchOp]
    allocations: _containers.RepeatedCompositeFieldContainer[AllocateOp]
    load: _common_pb2.LoadReport
    failed_remote_writes: bytes
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., publishes: _Optional[_Iterable[_Union[PublishOp, _Mapping]]] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointOp, _Mapping]]] = ..., releases: _Optional[_Iterable[_Union[ReleaseOp, _Mapping]]] = ..., renew_lease_ids: _Optional[_Iterable[str]] = ..., matches: _Optional[_Iterable[_Union[MatchOp, _Mapping]]] = ..., allocations: _Optional[_Iterable[_Union[AllocateOp, _Mapping]]] = ..., load: _Optional[_Union[_common_pb2.LoadReport, _Mapping]] = ..., failed_remote_writes: _Optional[bytes] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("copies", "publishes", "checkpoints", "matches", "allocations", "expired_lease_ids")
    COPIES_FIELD_NUMBER: _ClassVar[int]
    PUBLISHES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    copies: _containers.RepeatedCompositeFieldContainer[_common_pb2.CopyOp]
    publishes: _containers.RepeatedCompositeFieldContainer[PublishResult]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointResult]
    matches: _containers.RepeatedCompositeFieldContainer[MatchResult]
    allocations: _containers.RepeatedCompositeFieldContainer[AllocateResult]
    expired_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, copies: _Optional[_Iterable[_Union[_common_pb2.CopyOp, _Mapping]]] = ..., publishes: _Optional[_Iterable[_Union[PublishResult, _Mapping]]] = ..., checkpoints: _Optional[_Iterable[_Union[CheckpointResult, _Mapping]]] = ..., matches: _Optional[_Iterable[_Union[MatchResult, _Mapping]]] = ..., allocations: _Optional[_Iterable[_Union[AllocateResult, _Mapping]]] = ..., expired_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EvictNamespaceRequest(_message.Message):
    __slots__ = ("pool_id", "namespace", "all_salts")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_SALTS_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    namespace: _common_pb2.Namespace
    all_salts: bool
    def __init__(self, pool_id: _Optional[str] = ..., namespace: _Optional[_Union[_common_pb2.Namespace, _Mapping]] = ..., all_salts: _Optional[bool] = ...) -> None: ...

class EvictNamespaceResponse(_message.Message):
    __slots__ = ("removed_pages", "deferred_pages")
    REMOVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_PAGES_FIELD_NUMBER: _ClassVar[int]
    removed_pages: int
    deferred_pages: int
    def __init__(self, removed_pages: _Optional[int] = ..., deferred_pages: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("pool_id",)
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    def __init__(self, pool_id: _Optional[str] = ...) -> None: ...

class MediumStats(_message.Message):
    __slots__ = ("medium", "total_pages", "free_pages", "used_pages", "cached_pages", "evictable_pages", "pinned_pages", "evictions")
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    PINNED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    medium: _common_pb2.Medium
    total_pages: int
    free_pages: int
    used_pages: int
    cached_pages: int
    evictable_pages: int
    pinned_pages: int
    evictions: int
    def __init__(self, medium: _Optional[_Union[_common_pb2.Medium, str]] = ..., total_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., used_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., pinned_pages: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("pool_id", "epoch", "queried_tokens", "hit_tokens_device", "hit_tokens_host", "hit_tokens_remote", "skipped_prefill_tokens", "computed_prefill_tokens", "media", "mamba_slots_total", "mamba_slots_used", "mamba_evictions", "active_leases", "lease_expiries", "namespaces", "duplicate_pages", "remote_writes", "retained_pages", "retained_requests", "retention_ignored")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_DEVICE_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_HOST_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_REMOTE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MAMBA_SLOTS_USED_FIELD_NUMBER: _ClassVar[int]
    MAMBA_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PAGES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_WRITES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    RETAINED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_IGNORED_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    queried_tokens: int
    hit_tokens_device: int
    hit_tokens_host: int
    hit_tokens_remote: int
    skipped_prefill_tokens: int
    computed_prefill_tokens: int
    media: _containers.RepeatedCompositeFieldContainer[MediumStats]
    mamba_slots_total: int
    mamba_slots_used: int
    mamba_evictions: int
    active_leases: int
    lease_expiries: int
    namespaces: int
    duplicate_pages: int
    remote_writes: int
    retained_pages: int
    retained_requests: int
    retention_ignored: int
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., queried_tokens: _Optional[int] = ..., hit_tokens_device: _Optional[int] = ..., hit_tokens_host: _Optional[int] = ..., hit_tokens_remote: _Optional[int] = ..., skipped_prefill_tokens: _Optional[int] = ..., computed_prefill_tokens: _Optional[int] = ..., media: _Optional[_Iterable[_Union[MediumStats, _Mapping]]] = ..., mamba_slots_total: _Optional[int] = ..., mamba_slots_used: _Optional[int] = ..., mamba_evictions: _Optional[int] = ..., active_leases: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., namespaces: _Optional[int] = ..., duplicate_pages: _Optional[int] = ..., remote_writes: _Optional[int] = ..., retained_pages: _Optional[int] = ..., retained_requests: _Optional[int] = ..., retention_ignored: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStats]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStats, _Mapping]]] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("pool_id", "epoch", "after_seq", "heartbeat_interval_s", "packed_hashes")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    PACKED_HASHES_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    epoch: int
    after_seq: int
    heartbeat_interval_s: float
    packed_hashes: bool
    def __init__(self, pool_id: _Optional[str] = ..., epoch: _Optional[int] = ..., after_seq: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., packed_hashes: _Optional[bool] = ...) -> None: ...

class SubscribeResponse(_message.Message):
    __slots__ = ("batch", "heartbeat")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    batch: _events_pb2.EventBatch
    heartbeat: _events_pb2.Heartbeat
    def __init__(self, batch: _Optional[_Union[_events_pb2.EventBatch, _Mapping]] = ..., heartbeat: _Optional[_Union[_events_pb2.Heartbeat, _Mapping]] = ...) -> None: ...
