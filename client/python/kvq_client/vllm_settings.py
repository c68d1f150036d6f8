"""kv_connector_extra_config of the vLLM connector (docs/VLLM.md) and the
clients it builds, without vLLM or torch: parsed, checked and turned into
one sharded client per kvq namespace, all over one replica set, so that the
scheduler's and every worker's channels send a sequence to the same replica
(the rendezvous hash of sharding.py, the same as the C++ client's)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import threading
from typing import Any, Dict, Optional

from .circuit_breaker import CircuitBreaker
from .client import RetryPolicy
from .sharding import ReplicaSet, ShardedClient

# Near-lossless on a prefix hit (docs/VLLM.md, "What a hit costs"); kivi4 and
# kivi3 are the capacity options.
DEFAULT_SCHEME = "int8"


@dataclasses.dataclass
class KvqSettings:
    """kv_connector_extra_config keys, each `kvq_<field>` (all optional)."""
    # Where kvq is: one of address (one server), targets (a comma-separated
    # replica list) or dns (host:port resolving to every replica, e.g. the
    # StatefulSet's headless Service; re-resolved every dns_refresh_seconds).
    address: str = ""
    targets: str = ""
    dns: str = ""
    dns_refresh_seconds: float = 5.0
    # TLS: tls (system roots), tls_ca (PEM CA bundle), tls_cert + tls_key
    # (mutual TLS), tls_server_name (the name the certificate carries).
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    # Bearer token of the tenant: inline or read from a file (a mounted
    # Secret), not both.
    token: str = ""
    token_file: str = ""
    namespace: str = ""                # "" -> "vllm:<model>"
    scheme: str = DEFAULT_SCHEME
    ttl_seconds: int = 0               # 0: the server's default lease
    # Each fetch of a load (one layer group, at most load_buffer_bytes): the
    # forward pass waits for it, so a hung kvq costs a step this much until
    # the breaker opens. Each save's Append (in the background) gets
    # save_deadline_seconds.
    deadline_seconds: float = 5.0
    save_deadline_seconds: float = 30.0
    # The scheduler's calls run off vLLM's scheduler loop. A lookup is a
    # read-only MatchPrefix that gives up after lookup_deadline_seconds; the
    # lookup waits at most lookup_wait_seconds for its answer and otherwise
    # tells vLLM to ask again next step. CreateSequence (once vLLM allocated
    # the request's blocks), Stats and Release give up after
    # scheduler_deadline_seconds.
    lookup_deadline_seconds: float = 0.2
    scheduler_deadline_seconds: float = 1.0
    lookup_wait_seconds: float = 0.02
    # Circuit breaker: after breaker_failures consecutive service failures
    # kvq is skipped for breaker_backoff_seconds (doubling while it keeps
    # failing, at most breaker_max_backoff_seconds).
    breaker_failures: int = 3
    breaker_backoff_seconds: float = 10.0
    breaker_max_backoff_seconds: float = 300.0
    max_chunk_bytes: int = 1 << 20     # per Append / FetchDequant message
    load_buffer_bytes: int = 64 << 20  # host buffer of a load
    release_on_finish: bool = True
    # Saves travel as raw pages quantized here by kvq's native kernels where
    # the scheme has them (not fp8_e4m3); false sends them dense.
    quantize_on_client: bool = True
    # Generated tokens are saved too (multi-turn reuse), a chunk of at least
    # this many at a time; 0 saves prompt tokens only.
    save_decode_tokens: int = 128
    # vLLM must recompute failed loads; "set" turns kv_load_failure_policy to
    # "recompute" when it is "fail", "require" refuses to start instead.
    failure_policy: str = "set"
    # KV events (vLLM's --kv-events-config on): every events_audit_seconds
    # the scheduler re-probes (read-only MatchPrefix) the prefixes of up to
    # events_audit_prefixes finished requests whose announced blocks kvq
    # still held, and takes back what it evicted since; 0 turns it off.
    events_audit_seconds: float = 30.0
    events_audit_prefixes: int = 256

    @classmethod
    def from_extra_config(cls, extra: Dict[str, Any], model: str) -> "KvqSettings":
        known = {f"kvq_{name}" for name in cls.__dataclass_fields__}
        unknown = sorted(k for k in extra if k.startswith("kvq_") and k not in known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; "
                             f"known: {sorted(known)}")
        values = {}
        for k in known & set(extra):
            name = k[4:]
            default = cls.__dataclass_fields__[name].default
            values[name] = _typed(k, extra[k], type(default))
        s = cls(**values)
        if not s.namespace:
            s.namespace = fit_namespace("vllm:" + re.sub(r"[^A-Za-z0-9_.:-]", "_", model))
        s.check()
        return s

    def check(self) -> None:
        places = [k for k in ("address", "targets", "dns") if getattr(self, k)]
        if len(places) > 1:
            raise ValueError(f"kv_connector_extra_config: give one of kvq_address, kvq_targets "
                             f"and kvq_dns, got {', '.join('kvq_' + p for p in places)}")
        if not places:
            self.address = "localhost:50051"
        if self.namespace and (len(self.namespace) > 96 or
                               not re.fullmatch(r"[A-Za-z0-9_.:-]+", self.namespace)):
            raise ValueError(f"kvq_namespace must have 1 to 96 characters, letters, digits "
                             f"and - _ . : (kvq's rule, less room for the connector's "
                             f"suffixes), got {len(self.namespace)} characters")
        if "pre_rope" in self.scheme.split(":"):
            raise ValueError(f"kvq_scheme {self.scheme!r}: vLLM's cache holds keys after "
                             "RoPE, so pre_rope schemes cannot be used")
        if self.token and self.token_file:
            raise ValueError("kvq_token and kvq_token_file: give one")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("kvq_tls_cert and kvq_tls_key go together (mutual TLS)")
        if self.failure_policy not in ("set", "require"):
            raise ValueError(f"kvq_failure_policy = {self.failure_policy!r} must be \"set\" "
                             "or \"require\"")
        for name in ("lookup_deadline_seconds", "scheduler_deadline_seconds", "deadline_seconds",
                     "save_deadline_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"kvq_{name} = {getattr(self, name)} must be > 0")
        for name in ("lookup_wait_seconds", "save_decode_tokens", "events_audit_seconds",
                     "events_audit_prefixes"):
            if getattr(self, name) < 0:
                raise ValueError(f"kvq_{name} = {getattr(self, name)} must be >= 0")

    def read_token(self) -> Optional[str]:
        if self.token_file:
            try:
                with open(self.token_file, encoding="ascii") as f:
                    token = f.read().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"kvq_token_file={self.token_file}: cannot read "
                                 f"({getattr(e, 'strerror', None) or e})") from None
            if not token:
                raise ValueError(f"kvq_token_file={self.token_file}: the file is empty")
            return token
        return self.token or None

    def breaker(self) -> CircuitBreaker:
        return CircuitBreaker(self.breaker_failures, self.breaker_backoff_seconds,
                              self.breaker_max_backoff_seconds)


def _typed(key: str, value: Any, want: type) -> Any:
    """The JSON value of `key` as the field's type: vLLM passes the config
    through JSON, so numbers may arrive as strings from some launchers."""
    if want is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ValueError(f"{key} = {value!r} must be true or false")
    if want in (int, float):
        try:
            out = want(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} = {value!r} must be a number") from None
        return out
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {type(value).__name__}")
    return value


def apply_failure_policy(kv_transfer_config: Any, settings: KvqSettings) -> None:
    """A failed kvq load must make vLLM recompute the tokens, never fail the
    request. vLLM's kv_load_failure_policy defaults to "fail"; with
    kvq_failure_policy "set" the connector turns it to "recompute" (the
    scheduler reads it after building the connector), with "require" it
    refuses to start. ValueError names the setting."""
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", None)
    if policy is None or policy == "recompute":
        return  # A vLLM without the setting recomputes failed loads.
    if settings.failure_policy == "set":
        kv_transfer_config.kv_load_failure_policy = "recompute"
        return
    raise ValueError(
        f"KvqConnector needs kv_load_failure_policy \"recompute\" (a kvq miss or outage must "
        f"cost a recompute, not the request), got {policy!r}: add "
        "\"kv_load_failure_policy\": \"recompute\" to --kv-transfer-config, or drop "
        "kvq_failure_policy=require to let the connector set it")


_NAMESPACE_MAX = 128  # kvq's limit (letters, digits and - _ . :).


def fit_namespace(name: str) -> str:
    """`name` as kvq accepts it: other characters become "_", and a name
    over 128 characters keeps its first 95 and a hash of the whole."""
    name = re.sub(r"[^A-Za-z0-9_.:-]", "_", name)
    if len(name) <= _NAMESPACE_MAX:
        return name
    return name[:95] + ":" + hashlib.sha256(name.encode()).hexdigest()[:32]


def request_namespace(base: str, cache_salt: Optional[str], lora_name: Optional[str]) -> str:
    """The kvq namespace of a request: its prefixes are shared only with
    requests of the same cache salt (vLLM's per-tenant prefix isolation) and
    LoRA adapter, which make the same token ids mean other KV. The salt is
    hashed, never sent."""
    out = base
    if lora_name:
        out += f":lora-{lora_name}"
    if cache_salt:
        out += ":salt-" + hashlib.sha256(cache_salt.encode()).hexdigest()[:32]
    return fit_namespace(out)


def rank_namespace(namespace: str, rank: int, world_size: int) -> str:
    """Tensor-parallel ranks hold different KV heads in the same layout: each
    rank's sequences live in a namespace of their own so prefixes never mix."""
    return namespace if world_size == 1 else fit_namespace(f"{namespace}:tp{world_size}-{rank}")


class Clients:
    """One ShardedClient per namespace over one ReplicaSet (shared DNS
    refresh), built from the settings. Thread-safe; at most `max_namespaces`
    kept (the least recently used dropped)."""

    def __init__(self, settings: KvqSettings, max_namespaces: int = 64):
        self._settings = settings
        s = settings
        self.replica_set = (ReplicaSet(dns=s.dns, refresh=s.dns_refresh_seconds) if s.dns else
                            ReplicaSet(targets=[t for t in (s.targets or s.address).split(",")
                                                if t.strip()]))
        # No retries: a failed call costs one deadline and vLLM recomputes;
        # the circuit breaker decides when to try kvq again.
        self._kwargs = dict(deadline=s.deadline_seconds, retry=RetryPolicy(max_attempts=1),
                            tls=s.tls, tls_ca=s.tls_ca or None,
                            tls_cert=s.tls_cert or None, tls_key=s.tls_key or None,
                            tls_server_name=s.tls_server_name or None, token=s.read_token(),
                            max_message_bytes=max(64 << 20, 2 * s.max_chunk_bytes))
        self._lock = threading.Lock()
        self._clients: Dict[str, ShardedClient] = {}
        self._max = max_namespaces

    def get(self, namespace: str) -> ShardedClient:
        with self._lock:
            c = self._clients.pop(namespace, None)
            if c is None:
                c = ShardedClient(namespace=namespace, replica_set=self.replica_set,
                                  **self._kwargs)
            self._clients[namespace] = c  # Most recently used last.
            if len(self._clients) > self._max:
                # Dropped, not closed: a call in flight may still use it;
                # its channels close when the last reference goes.
                self._clients.pop(next(iter(self._clients)))
            return c

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
        self.replica_set.close()
