"""KV tiers below the device pool, the compute side: L2 host pages (batched copies) and L3
(pages as tensors, background writes, validated loads) through the page store, `pagestore`
(Redis client, payload format and MAC). The cache service decides what moves where; this
package moves the bytes."""
from compute_service.tiers.copies import (CopyRun, allocate_host_pool, gather_pages, move_pages,
                                          plan_runs, scatter_pages)
from compute_service.tiers.payload import (FORMAT_VERSION, REASONS, PageData, PageLayout,
                                           PayloadRejected, decode, encode)
from compute_service.tiers.remote import RemoteCounters, RemoteTier, RemoteTierConfig
from prefixcache.v1 import cache_service_pb2 as _pb

# --l3-write-policy values -> RegisterPoolRequest.remote_write_policy.
WRITE_POLICIES = {
    "none": _pb.REMOTE_WRITE_POLICY_UNSPECIFIED,
    "write-through": _pb.REMOTE_WRITE_POLICY_WRITE_THROUGH,
    "write-back": _pb.REMOTE_WRITE_POLICY_WRITE_BACK,
    "hot": _pb.REMOTE_WRITE_POLICY_HOT,
}

__all__ = ["FORMAT_VERSION", "REASONS", "WRITE_POLICIES", "CopyRun", "PageData", "PageLayout",
           "PayloadRejected", "RemoteCounters", "RemoteTier", "RemoteTierConfig",
           "allocate_host_pool", "decode", "encode", "gather_pages", "move_pages", "plan_runs",
           "scatter_pages"]
