"""The operations of a Step, one module per family (base.py says what an operation is); their
order is `CacheCore.step`'s (cache_service/core.py, design.md §4)."""
from cache_service.step.allocate import Allocate
from cache_service.step.base import StepCheck, StepOperation
from cache_service.step.checkpoint import Checkpoint
from cache_service.step.load import LoadReport
from cache_service.step.match import Match
from cache_service.step.publish import Publish
from cache_service.step.release import Release, Renew
from cache_service.step.remote_failures import RemoteWriteFailures
from cache_service.step.write_through import WriteThrough

__all__ = ["Allocate", "Checkpoint", "LoadReport", "Match", "Publish", "Release",
           "RemoteWriteFailures", "Renew", "StepCheck", "StepOperation", "WriteThrough"]
