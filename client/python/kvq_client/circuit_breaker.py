"""A circuit breaker for calls to kvq from a latency-critical loop (the vLLM
connector): after `failures` consecutive failures it opens and callers skip
kvq for `backoff_seconds`; then one trial call is let through (half open):
its success closes the breaker, its failure opens it again for twice as long
(at most `max_backoff_seconds`). Thread-safe; the clock is injectable for
tests."""

from __future__ import annotations

import enum
import threading
import time
from typing import Callable

import grpc

from .client import KvqError

# Codes that say the service (not the request) is in trouble. NOT_FOUND
# (an evicted sequence), ALREADY_EXISTS or INVALID_ARGUMENT are answers of a
# healthy server and do not count.
_SERVICE_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DATA_LOSS,
})


def is_service_failure(error: BaseException) -> bool:
    return isinstance(error, KvqError) and error.code in _SERVICE_FAILURES


class BreakerState(enum.IntEnum):
    CLOSED = 0     # Calls go through.
    OPEN = 1       # Calls are skipped until the back-off ends.
    HALF_OPEN = 2  # One trial call is out.


class CircuitBreaker:

    def __init__(self, failures: int = 3, backoff_seconds: float = 10.0,
                 max_backoff_seconds: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        if failures < 1:
            raise ValueError(f"failures = {failures} must be at least 1")
        if backoff_seconds <= 0 or max_backoff_seconds < backoff_seconds:
            raise ValueError(f"backoff_seconds = {backoff_seconds} must be > 0 and at most "
                             f"max_backoff_seconds = {max_backoff_seconds}")
        self._failures_to_open = failures
        self._base_backoff = backoff_seconds
        self._max_backoff = max_backoff_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._backoff = backoff_seconds
        self._open_until = 0.0
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._state == BreakerState.OPEN and self._clock() >= self._open_until:
                return BreakerState.HALF_OPEN  # The next allow() is the trial.
            return self._state

    def allow(self) -> bool:
        """Whether a call may go to kvq now. While open: False until the
        back-off ends, then True once (the trial) and False until it reports."""
        with self._lock:
            if self._state == BreakerState.CLOSED:
                return True
            if self._state == BreakerState.OPEN and self._clock() >= self._open_until:
                self._state = BreakerState.HALF_OPEN
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = BreakerState.CLOSED
            self._consecutive = 0
            self._backoff = self._base_backoff

    def record_failure(self) -> bool:
        """Counts a service failure; True if the breaker opened because of it."""
        with self._lock:
            self._consecutive += 1
            if self._state == BreakerState.HALF_OPEN:
                self._backoff = min(self._backoff * 2, self._max_backoff)
            elif self._consecutive < self._failures_to_open:
                return False
            self._state = BreakerState.OPEN
            self._open_until = self._clock() + self._backoff
            self.times_opened += 1
            return True

    def record(self, error: BaseException | None) -> bool:
        """record_success for None, record_failure for a service failure,
        nothing for other errors (a healthy server's answer: success). True if
        the breaker opened."""
        if error is None or not is_service_failure(error):
            self.record_success()
            return False
        return self.record_failure()
