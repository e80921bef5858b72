"""prefixcache_client: the torch-free Python client of prefixcache's gRPC contract.

What anything outside a service needs to talk to one: the gateway, tools and benchmarks, and
users' applications. It imports grpc, protobuf, numpy, the generated `prefixcache` messages and
`service_shell`'s channel options and TLS, never torch nor the services' packages.

- `ComputeClient` (`prefixcache_client.compute`): Generate, Abort, GetModelInfo and
  GetTokenizer of a compute worker or of the gateway, which serves the same API.
- `CacheClient` (`prefixcache_client.cache`): the cache service's calls and its resubscribing
  event stream.
- `CacheError` / `ErrorCode` (`prefixcache_client.errors`): the cache's one error type, raised
  alike by the embedded `CacheCore` and by `CacheClient` (as `CacheRejectedError`).
- The page hash (`prefixcache_client.hash`): the chained SHA-256 every client and indexer
  recomputes, and its namespace limits. `python -m prefixcache_client.hash --help` prints hashes.
- Token pages (`prefixcache_client.pages`): `common_pages`, the leading whole pages two token
  byte strings share (the cache's radix tree and the compute scheduler both use it).
- The tokenizer (`prefixcache_client.tokenizer`): the one implementation the workers and the
  gateway tokenize text and chats with (`tokenizers`, chat templates in jinja2's sandbox), rebuilt
  from a worker's GetTokenizer files by `from_files`.

The names below are loaded on first use, so importing one module (the cache core imports only
`errors` and `hash`) does not import the others, and `python -m prefixcache_client.hash` runs a
module the package has not imported yet.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "cache": ("Backoff", "CacheClient", "CacheClientError", "CacheRejectedError",
              "CacheUnavailableError", "Subscription"),
    "compute": ("Completion", "ComputeClient", "ComputeClientError", "GenerateStream"),
    "errors": ("CacheError", "ErrorCode"),
    "hash": ("HASH_BYTES", "MAX_NAME_BYTES", "MAX_TOKEN_ID", "NS_DOMAIN", "chain_hashes",
             "namespace_seed", "page_hash", "prompt_hashes", "token_bytes"),
    "tokenizer": ("ByteTokenizer", "ChatTemplateError", "JsonTokenizer", "NoChatTemplate",
                  "TokenizerError"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "HASH_BYTES", "MAX_NAME_BYTES", "MAX_TOKEN_ID", "NS_DOMAIN", "Backoff", "ByteTokenizer",
    "CacheClient", "CacheClientError", "CacheError", "CacheRejectedError",
    "CacheUnavailableError", "ChatTemplateError", "Completion", "ComputeClient",
    "ComputeClientError", "ErrorCode", "GenerateStream", "JsonTokenizer", "NoChatTemplate",
    "Subscription", "TokenizerError", "chain_hashes", "namespace_seed", "page_hash",
    "prompt_hashes", "token_bytes",
]

if TYPE_CHECKING:
    from prefixcache_client.cache import (Backoff, CacheClient, CacheClientError,
                                          CacheRejectedError, CacheUnavailableError, Subscription)
    from prefixcache_client.compute import (Completion, ComputeClient, ComputeClientError,
                                            GenerateStream)
    from prefixcache_client.errors import CacheError, ErrorCode
    from prefixcache_client.hash import (HASH_BYTES, MAX_NAME_BYTES, MAX_TOKEN_ID, NS_DOMAIN,
                                         chain_hashes, namespace_seed, page_hash, prompt_hashes,
                                         token_bytes)
    from prefixcache_client.tokenizer import (ByteTokenizer, ChatTemplateError, JsonTokenizer,
                                              NoChatTemplate, TokenizerError)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
