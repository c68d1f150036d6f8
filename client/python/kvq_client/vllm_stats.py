"""Counters of the vLLM connector, without vLLM: each side (scheduler,
worker) counts into one ConnectorCounters; vLLM carries their dict from the
workers to its logger process, adds them up (merge) and hands them to the
Prometheus metrics of vllm_connector.py."""

from __future__ import annotations

import threading
from typing import Any, Dict, List

# Monotonic counts summed across workers and intervals.
COUNTS = (
    "lookup_hits",        # lookups that found tokens in kvq
    "lookup_misses",      # lookups that found none
    "lookup_skipped",     # lookups answered 0 because the breaker was open
    "hit_tokens",         # tokens those hits offered
    "tokens_loaded",      # tokens written into vLLM's cache from kvq (all layers)
    "tokens_saved",       # tokens committed to kvq (all layers)
    "bytes_loaded",       # payload bytes received
    "bytes_saved",        # payload bytes sent
    "load_failures",      # loads that failed (their blocks recomputed)
    "save_failures",      # saves that failed or were dropped
    "rpc_failures",       # service failures counted by the breaker
    "breaker_opened",     # times the breaker opened
)
# Latency samples (seconds), reduced to their sum and count.
SAMPLES = ("load_seconds", "save_seconds", "lookup_seconds")


class ConnectorCounters:
    """Thread-safe; take() returns the counts since the last take()."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = {}
        self._samples: Dict[str, List[float]] = {}
        self.breaker_state = 0  # CircuitBreaker state: 0 closed, 1 open, 2 half open.

    def add(self, name: str, n: int = 1) -> None:
        if name not in COUNTS:
            raise KeyError(name)
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def observe(self, name: str, seconds: float) -> None:
        if name not in SAMPLES:
            raise KeyError(name)
        with self._lock:
            self._samples.setdefault(name, []).append(seconds)

    def take(self) -> Dict[str, Any]:
        with self._lock:
            counts, self._counts = self._counts, {}
            samples, self._samples = self._samples, {}
        out: Dict[str, Any] = dict(counts)
        out.update({k: list(v) for k, v in samples.items()})
        out["breaker_state"] = self.breaker_state
        return out


def merge(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """Sums two take() dicts (two workers, or two intervals); the breaker
    state is the worst (open over half open over closed)."""
    out: Dict[str, Any] = {}
    for k in set(a) | set(b):
        if k == "breaker_state":
            order = {1: 2, 2: 1, 0: 0}
            out[k] = max(a.get(k, 0), b.get(k, 0), key=lambda s: order.get(s, 0))
        elif k in SAMPLES:
            out[k] = list(a.get(k, [])) + list(b.get(k, []))
        else:
            out[k] = a.get(k, 0) + b.get(k, 0)
    return out


def is_empty(d: Dict[str, Any]) -> bool:
    return not any(v for k, v in d.items() if k != "breaker_state") and \
        not d.get("breaker_state")


def reduce(d: Dict[str, Any]) -> Dict[str, float]:
    """One interval for vLLM's log line: counts, mean latencies in ms."""
    out: Dict[str, float] = {k: d.get(k, 0) for k in COUNTS}
    for k in SAMPLES:
        xs = d.get(k, [])
        out[f"{k[:-8]}_ms_mean"] = 1000.0 * sum(xs) / len(xs) if xs else 0.0
    out["breaker_state"] = d.get("breaker_state", 0)
    return out


def note_outcome(breaker, counters: ConnectorCounters, error) -> bool:
    """Reports a call's outcome (None: success) to the circuit breaker and
    the counters; True if the breaker opened because of it."""
    from .circuit_breaker import is_service_failure
    if error is not None and is_service_failure(error):
        counters.add("rpc_failures")
    opened = breaker.record(error)
    if opened:
        counters.add("breaker_opened")
    counters.breaker_state = int(breaker.state)
    return opened
