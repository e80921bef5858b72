"""The one error type of the cache: `CacheCore` raises it, the gRPC server maps `code` to a status
code, and `CacheClient` raises a subclass of it with the same code, so code that catches it runs
against an embedded core and a remote one alike."""
from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"


class CacheError(Exception):
    """A rejected call. Raised before any state changed; the message names the bad field."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


def invalid(message: str) -> CacheError:
    return CacheError(ErrorCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> CacheError:
    return CacheError(ErrorCode.NOT_FOUND, message)


def precondition(message: str) -> CacheError:
    return CacheError(ErrorCode.FAILED_PRECONDITION, message)


def exhausted(message: str) -> CacheError:
    return CacheError(ErrorCode.RESOURCE_EXHAUSTED, message)
