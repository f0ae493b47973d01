"""The model's one worker: the engine decodes one sequence at a time, so requests wait in a FIFO queue of
bounded length and a thread of their own runs them in arrival order, away from the event loop, which keeps
answering (health, metrics, 429s, other streams' bytes) while a request decodes."""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from pyinfer.apps.server.openai_errors import ApiError

_DONE = object()  # a job's last item


class Job:
    """One request in the engine: `work(job)` runs on the engine thread and hands its results to `emit`; the
    event loop reads them with `results()`. `cancel()` (the client went away) stops it at its next token,
    or before it starts."""

    def __init__(self, work: Callable[[Job], None]) -> None:
        self.work = work
        self.arrived = time.monotonic()
        self.started = self.arrived  # when the engine took it
        self.cancelled = threading.Event()
        self.engine_stopping: threading.Event | None = None  # set by the engine that takes the job
        self._loop = asyncio.get_running_loop()
        self._items: asyncio.Queue = asyncio.Queue()

    def should_stop(self) -> bool:
        return self.cancelled.is_set() or bool(self.engine_stopping and self.engine_stopping.is_set())

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, item) -> None:
        """Called on the engine thread: an item (or an exception) for the request's handler."""
        try:
            self._loop.call_soon_threadsafe(self._items.put_nowait, item)
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            self.cancel()

    async def results(self) -> AsyncIterator:
        """What the work emits, until it ends; an emitted exception is raised here."""
        while (item := await self._items.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item


class Engine:
    """Runs jobs one at a time, first come first served, at most `max_waiting` waiting behind the running one."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.waiting = 0  # jobs queued, not started
        self.busy = False  # a job is running
        self.stopping = threading.Event()
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._seconds_per_job = 1.0  # moving average, for Retry-After
        self._thread = threading.Thread(target=self._run, name="pyinfer-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queues the job, or raises 429 (queue full, with Retry-After) or 503 (shutting down)."""
        with self._lock:
            if self.stopping.is_set():
                raise ApiError(503, "the server is shutting down", code="shutting_down")
            if self.waiting >= self.max_waiting:
                retry = self.retry_after()
                raise ApiError(429, f"the server is busy: {self.waiting} requests are waiting (--queue "
                               f"{self.max_waiting}); retry in {retry} s", code="queue_full",
                               headers={"Retry-After": str(retry)})
            self.waiting += 1
        self._queue.put(job)

    def retry_after(self) -> int:
        """Seconds until a place in the queue is likely free: the running job and the first waiting one."""
        return max(1, math.ceil(self._seconds_per_job * (1 + min(self.waiting, 1))))

    def stop(self) -> None:
        """From the signal handler: the running job ends at its next token, waiting ones get 503."""
        self.stopping.set()

    def close(self) -> None:
        self.stop()
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            with self._lock:
                self.waiting -= 1
            if job.cancelled.is_set():
                job.emit(_DONE)
                continue
            if self.stopping.is_set():
                job.emit(ApiError(503, "the server is shutting down", code="shutting_down"))
                job.emit(_DONE)
                continue
            job.engine_stopping = self.stopping
            self.busy = True
            t0 = job.started = time.monotonic()
            try:
                job.work(job)
            except Exception as exc:  # handed to the request's handler, which answers it; the engine goes on
                job.emit(exc)
            finally:
                self.busy = False
                job.emit(_DONE)
                self._seconds_per_job = 0.8 * self._seconds_per_job + 0.2 * (time.monotonic() - t0)
