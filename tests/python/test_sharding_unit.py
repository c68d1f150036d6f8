"""The Python client's sharding without a server: the specified hash, the
golden placements the C++ client produces (tests/client/testdata), spread
and minimal movement, and the replica set with an injected resolver."""

import os
import threading
import time

import pytest

from kvq_client import sharding
from kvq_client.sharding import (ReplicaSet, fnv1a64, hash64, mix64, prefix_key, ranking,
                                 sequence_key, winner)

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "client", "testdata",
                      "rendezvous_golden.tsv")


def test_hash_matches_its_specification():
    assert fnv1a64(b"") == 0xcbf29ce484222325
    assert fnv1a64(b"a") == 0xaf63dc4c8601ec8c
    assert fnv1a64(b"foobar") == 0x85944171f73967e8
    assert mix64(0) == 0 and mix64(1) == 0x5692161d100b05e5
    assert hash64(b"a") == mix64(0xaf63dc4c8601ec8c)


def test_keys_match_the_cpp_layout():
    assert sequence_key("ns", "id") == b"ns\0id"
    assert prefix_key("t", [1, -2, 0x01020304], 2) == b"prefix\0t\0\x01\0\0\0\xfe\xff\xff\xff"
    assert prefix_key("t", [1, -2, 3], 2) == prefix_key("t", [1, -2, 7, 8], 2)


def test_golden_placements_agree_with_the_cpp_client():
    with open(GOLDEN) as f:
        lines = f.read().splitlines()
    replicas = lines[0].split("\t")[1:]
    assert lines[0].startswith("# replicas") and len(replicas) == 5
    rows = [l.split("\t") for l in lines[2:]]
    assert len(rows) == 50
    for kind, ns, text, hex_hash, order in rows:
        if kind == "seq":
            key = sequence_key(ns, text)
        else:
            key = prefix_key(ns, [int(t) for t in text.split(",")], 32)
        assert f"{hash64(key):016x}" == hex_hash, (kind, ns, text)
        assert ranking(key, replicas) == [int(i) for i in order.split(",")], (kind, ns, text)


def test_spread_and_minimal_movement():
    replicas = [f"127.0.0.1:{5000 + i}" for i in range(3)]
    keys = [sequence_key("", str(i)) for i in range(6000)]
    before = [winner(k, replicas) for k in keys]
    for r in range(3):
        assert abs(before.count(r) - 2000) < 2000 * 0.08
    survivors = replicas[:1] + replicas[2:]
    for k, w in zip(keys, before):
        after = survivors[winner(k, survivors)]
        if w != 1:
            assert after == replicas[w]
        else:
            assert after == replicas[ranking(k, replicas)[1]]


class FakeDns:
    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def __call__(self, host, port):
        assert (host, port) == ("kvq.ns.svc.cluster.local", "50051")
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return list(self.answer)


def test_replica_set_follows_dns_and_keeps_the_list_on_failure():
    dns = FakeDns(["127.0.1.2:50051", "127.0.1.1:50051", "127.0.1.2:50051"])
    rs = ReplicaSet(dns="kvq.ns.svc.cluster.local:50051", refresh=0, resolver=dns)
    assert rs.snapshot() == (("127.0.1.1:50051", "127.0.1.2:50051"), 1)
    dns.answer = ["127.0.1.1:50051", "127.0.1.2:50051"]
    rs.refresh()
    assert rs.version == 1
    dns.answer = ["127.0.1.1:50051", "127.0.1.3:50051"]
    rs.refresh()
    assert rs.snapshot() == (("127.0.1.1:50051", "127.0.1.3:50051"), 2)
    dns.answer = OSError("NXDOMAIN")
    with pytest.raises(OSError):
        rs.refresh()
    dns.answer = []
    with pytest.raises(LookupError, match="resolved to no address"):
        rs.refresh()
    assert rs.snapshot() == (("127.0.1.1:50051", "127.0.1.3:50051"), 2)


def test_replica_set_refreshes_in_the_background():
    dns = FakeDns(["127.0.1.1:50051"])
    rs = ReplicaSet(dns="kvq.ns.svc.cluster.local:50051", refresh=0.01, resolver=dns)
    dns.answer = ["127.0.1.1:50051", "127.0.1.2:50051"]
    for _ in range(2000):  # Bounded wait, not a timing assertion.
        if len(rs.replicas) == 2:
            break
        time.sleep(0.005)
    rs.close()
    assert rs.replicas == ("127.0.1.1:50051", "127.0.1.2:50051")


def test_bad_targets_are_named():
    with pytest.raises(ValueError, match="the replica list is empty"):
        ReplicaSet(targets=[])
    with pytest.raises(ValueError, match='"b" must be host:port'):
        ReplicaSet(targets=["a:1", "b"])
    with pytest.raises(ValueError, match="port that is not a number"):
        ReplicaSet(targets=["a:http"])


def test_getaddrinfo_resolves_loopback():
    assert sharding.resolve_with_getaddrinfo("127.0.0.1", "7") == ["127.0.0.1:7"]
