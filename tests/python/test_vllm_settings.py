"""The vLLM connector's settings, clients and circuit breaker, without vLLM
or a server (kvq_client/vllm_settings.py, circuit_breaker.py)."""

import re
import types

import grpc
import pytest

from kvq_client.circuit_breaker import BreakerState, CircuitBreaker
from kvq_client.client import KvqError
from kvq_client.sharding import sequence_key, winner
from kvq_client.vllm_settings import (Clients, KvqSettings, apply_failure_policy,
                                      rank_namespace, request_namespace)

UNAVAILABLE = KvqError(grpc.StatusCode.UNAVAILABLE, "down")


def test_settings_reject_unknown_keys_conflicts_and_pre_rope():
    with pytest.raises(ValueError, match=r"unknown keys \['kvq_adress'\]"):
        KvqSettings.from_extra_config({"kvq_adress": "x"}, "m")
    with pytest.raises(ValueError, match="kvq_scheme 'kivi2:pre_rope'.*after RoPE"):
        KvqSettings.from_extra_config({"kvq_scheme": "kivi2:pre_rope"}, "m")
    with pytest.raises(ValueError, match="give one of kvq_address, kvq_targets and kvq_dns, "
                                         "got kvq_address, kvq_dns"):
        KvqSettings.from_extra_config({"kvq_address": "a:1", "kvq_dns": "b:1"}, "m")
    with pytest.raises(ValueError, match="kvq_token and kvq_token_file: give one"):
        KvqSettings.from_extra_config({"kvq_token": "t" * 20, "kvq_token_file": "/f"}, "m")
    with pytest.raises(ValueError, match="kvq_tls_cert and kvq_tls_key go together"):
        KvqSettings.from_extra_config({"kvq_tls_cert": "/c.pem"}, "m")
    with pytest.raises(ValueError, match="kvq_breaker_failures = 'x' must be a number"):
        KvqSettings.from_extra_config({"kvq_breaker_failures": "x"}, "m")
    s = KvqSettings.from_extra_config({"other": 1, "kvq_tls": "true",
                                       "kvq_scheduler_deadline_seconds": "0.25"}, "org/model")
    assert (s.address, s.namespace, s.scheme, s.tls, s.scheduler_deadline_seconds) == \
        ("localhost:50051", "vllm:org_model", "int8", True, 0.25)
    with pytest.raises(ValueError, match="kvq_namespace must have 1 to 96 characters, letters"):
        KvqSettings.from_extra_config({"kvq_namespace": "team/a"}, "m")


def test_token_file_is_read_and_an_empty_or_missing_one_is_refused(tmp_path):
    f = tmp_path / "token"
    f.write_text("3f9c2e0d8a7b41c6a5e2d9f0b1c4e7a8\n")
    assert KvqSettings(token_file=str(f)).read_token() == "3f9c2e0d8a7b41c6a5e2d9f0b1c4e7a8"
    f.write_text("\n")
    with pytest.raises(ValueError, match="the file is empty"):
        KvqSettings(token_file=str(f)).read_token()
    with pytest.raises(ValueError, match="kvq_token_file=.*missing: cannot read"):
        KvqSettings(token_file=str(tmp_path / "missing")).read_token()
    assert KvqSettings().read_token() is None


def test_failure_policy_is_set_to_recompute_or_refused():
    config = types.SimpleNamespace(kv_load_failure_policy="fail")
    apply_failure_policy(config, KvqSettings())
    assert config.kv_load_failure_policy == "recompute"
    config = types.SimpleNamespace(kv_load_failure_policy="fail")
    with pytest.raises(ValueError, match="needs kv_load_failure_policy \"recompute\".*got 'fail'"):
        apply_failure_policy(config, KvqSettings(failure_policy="require"))
    config = types.SimpleNamespace(kv_load_failure_policy="recompute")
    apply_failure_policy(config, KvqSettings(failure_policy="require"))
    assert config.kv_load_failure_policy == "recompute"


def test_salt_lora_and_rank_make_separate_namespaces_kvq_accepts():
    base = "vllm:m"
    assert request_namespace(base, None, None) == base
    salted = request_namespace(base, "tenant-1", None)
    assert salted != base and "tenant-1" not in salted  # Hashed, never sent.
    assert salted == request_namespace(base, "tenant-1", None)
    assert salted != request_namespace(base, "tenant-2", None)
    assert request_namespace(base, None, "sql/adapter v2") == "vllm:m:lora-sql_adapter_v2"
    assert rank_namespace(base, 0, 1) == base
    assert {rank_namespace(base, r, 2) for r in range(2)} == {"vllm:m:tp2-0", "vllm:m:tp2-1"}
    # kvq takes at most 128 characters: a long name keeps a hash of itself.
    long = request_namespace("vllm:" + "m" * 90, "salt", "lora-" + "x" * 60)
    assert len(long) == 128 and re.fullmatch(r"[A-Za-z0-9_.:-]+", long)
    assert long != request_namespace("vllm:" + "m" * 90, "salt", "lora-" + "x" * 61)


def test_every_client_of_a_replica_set_places_a_sequence_alike():
    # The scheduler's and each worker's Clients are built from the same
    # settings: a sequence id goes to one replica from all of them.
    s = KvqSettings(targets="10.0.0.3:50051,10.0.0.1:50051,10.0.0.2:50051")
    a, b = Clients(s), Clients(s)
    try:
        replicas = sorted(s.targets.split(","))
        for i in range(50):
            sid = f"s{i:016x}"
            want = replicas[winner(sequence_key("ns", sid), replicas)]
            assert a.get("ns").replica_of(sid) == b.get("ns").replica_of(sid) == want
    finally:
        a.close()
        b.close()


def test_breaker_opens_after_consecutive_failures_and_retries_after_the_backoff():
    now = [0.0]
    b = CircuitBreaker(failures=3, backoff_seconds=10, max_backoff_seconds=25,
                       clock=lambda: now[0])
    assert b.allow() and not b.record(UNAVAILABLE) and not b.record(UNAVAILABLE)
    # A healthy server's answer resets the count.
    b.record(KvqError(grpc.StatusCode.NOT_FOUND, "evicted"))
    assert not b.record(UNAVAILABLE) and not b.record(UNAVAILABLE)
    assert b.record(KvqError(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"))
    assert b.state == BreakerState.OPEN and not b.allow()
    now[0] = 9.9
    assert not b.allow()
    now[0] = 10.0
    assert b.state == BreakerState.HALF_OPEN
    assert b.allow() and not b.allow()  # One trial at a time.
    assert b.record(UNAVAILABLE)  # The trial failed: open for twice as long.
    now[0] = 29.9
    assert not b.allow()
    now[0] = 30.0
    assert b.allow()
    b.record(UNAVAILABLE)  # 40 s, capped at 25.
    now[0] = 55.0
    assert b.allow()
    b.record(None)
    assert b.state == BreakerState.CLOSED and b.allow() and b.allow()
    assert b.times_opened == 3
