"""`CacheCaller`: the thread that runs an engine's overlapped cache calls while the engine
thread runs the forward (compute_service.engine.step_planner, "Overlap").

One daemon thread per engine, started on the first call and stopped by `close`; calls run one
at a time in the order they were submitted, and the engine submits the next only after it took
the answer of the previous one, so the cache sees exactly the sequence of Step calls a
synchronous engine would send. Each answer (or the exception the call raised) comes back
through a `concurrent.futures.Future`.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from prefixcache.v1 import cache_service_pb2 as pb
from service_shell import tracing


class CacheCaller:
    def __init__(self, cache) -> None:
        """`cache`: anything with `step(StepRequest) -> StepResponse` (read at each call, so a
        test may wrap it)."""
        self.cache = cache
        self._queue: queue.SimpleQueue[tuple[pb.StepRequest, Future, object] | None] = \
            queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, req: pb.StepRequest, trace=None) -> Future:
        """`trace`: the step's span context, current on the caller thread during the call (a
        remote cache's client sends it as traceparent: service_shell.tracing)."""
        future: Future = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="cache-caller",
                                                daemon=True)
                self._thread.start()
            self._queue.put((req, future, trace))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            req, future, trace = item
            if not future.set_running_or_notify_cancel():
                continue
            token = tracing.attach(trace)
            try:
                future.set_result(self.cache.step(req))
            except BaseException as exc:  # handed to the engine thread, which decides
                future.set_exception(exc)
            finally:
                tracing.detach(token)

    def close(self, wait: bool = True, timeout_s: float = 10.0) -> None:
        """Stops the thread once the calls already submitted are done (waiting for that unless
        `wait` is False); a later `submit` starts a new one."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None and wait and thread is not threading.current_thread():
            thread.join(timeout_s)
