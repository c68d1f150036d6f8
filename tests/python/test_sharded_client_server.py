"""The Python ShardedClient against three real kvq-server processes on
loopback: spread, prefix placement, one replica killed (SIGKILL) while the
others keep serving, new sequences on the survivors.

Needs the server binary: $KVQ_SERVER_BIN (ctest sets it), else skipped."""

import os
import signal
import tempfile

import grpc
import numpy as np
import pytest

from kvq_client import AttendQuery, KvqError, ModelLayout, RetryPolicy, ShardedClient
from live_server import needs_server, start_server

pytestmark = needs_server

LAYERS, HEADS, QHEADS, DIM, TOKENS = 2, 1, 2, 32, 40


@pytest.fixture
def servers():
    with tempfile.TemporaryDirectory() as tmp:
        started = []
        try:
            for i in range(3):
                started.append(start_server(os.path.join(tmp, f"port{i}"),
                                            "--metrics_address=127.0.0.1:0",
                                            "--capacity_bytes=67108864", "--backend=cpu"))
            yield started
        finally:
            for proc, _ in started:
                proc.kill()
                proc.wait()


def connect(addresses):
    return ShardedClient(targets=addresses, namespace="pyshard", deadline=5.0,
                         retry=RetryPolicy(max_attempts=2), id_seed=20261206)


def layout():
    return ModelLayout(LAYERS, HEADS, QHEADS, DIM)


def counts(client):
    return {r: s.sequences for r, s in client.stats_all().items() if not isinstance(s, KvqError)}


def test_spread_and_prefix_placement(servers):
    addresses = [a for _, a in servers]
    with connect(addresses) as kvq:
        n = 1800  # Ports differ per run: a 15 % band is 4.5 sd of a replica's count.
        placed = {}
        for _ in range(n):
            sid = kvq.create_sequence(layout(), scheme="fp16").sequence_id
            placed[kvq.replica_of(sid)] = placed.get(kvq.replica_of(sid), 0) + 1
        c = counts(kvq)
        assert sorted(c) == sorted(addresses)
        for a in addresses:
            assert c[a] == placed[a]
            assert n / 3 * 0.85 <= c[a] <= n / 3 * 1.15, c

        prompt = list(range(2000, 2064))
        first = kvq.create_sequence(layout(), scheme="fp16", prompt_token_ids=prompt)
        rng = np.random.default_rng(0)
        k = rng.standard_normal((LAYERS, HEADS, 64, DIM)).astype(np.float32)
        kvq.append_prompt(first.sequence_id, k, k)  # The ids came with the create.
        # The read-only probe asks the prefix's replica: it sees the prefix.
        probe = kvq.match_prefix(layout(), scheme="fp16", prompt_token_ids=prompt + [99])
        assert probe.matched_tokens == 64
        for i in range(6):
            s = kvq.create_sequence(layout(), scheme="fp16", prompt_token_ids=prompt + [i])
            assert kvq.replica_of(s.sequence_id) == kvq.replica_of(first.sequence_id)
            assert s.num_tokens == 64, "the shared prefix was not reused"


def test_a_killed_replica_costs_only_its_own_sequences(servers):
    addresses = [a for _, a in servers]
    rng = np.random.default_rng(1)
    with connect(addresses) as kvq:
        ids, keys = [], {}
        for _ in range(30):
            sid = kvq.create_sequence(layout(), scheme="fp16").sequence_id
            k = rng.standard_normal((LAYERS, HEADS, TOKENS, DIM)).astype(np.float32)
            v = rng.standard_normal((LAYERS, HEADS, TOKENS, DIM)).astype(np.float32)
            kvq.append_prompt(sid, k, v)
            ids.append(sid)
            keys[sid] = k.astype(np.float16)
        queries = [AttendQuery(sid, rng.standard_normal((1, QHEADS, DIM)).astype(np.float32))
                   for sid in ids]
        before = kvq.attend(1, queries)

        # One decode session over all three replicas, items in reverse order.
        order = list(reversed(range(len(ids))))
        sids = [ids[i] for i in order]
        kk = rng.standard_normal((len(ids), HEADS, DIM)).astype(np.float32)
        qq = rng.standard_normal((len(ids), QHEADS, DIM)).astype(np.float32)
        session = kvq.decode_session(deadline=60)
        out, lse = session.step_batch(0, sids, kk, kk, qq)
        ref = kvq.attend(0, [AttendQuery(sid, qq[j:j + 1], [TOKENS]) for j, sid in enumerate(sids)])
        for j in range(len(sids)):
            np.testing.assert_allclose(out[j], ref[j][0][0], atol=1e-4)

        victim_proc, victim = servers[1]
        lost = [s for s in ids if kvq.replica_of(s) == victim]
        kept = [s for s in ids if kvq.replica_of(s) != victim]
        assert lost and kept
        victim_proc.send_signal(signal.SIGKILL)
        victim_proc.wait()

        for sid in lost:
            with pytest.raises(KvqError) as e:
                kvq.fetch(sid)
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            assert f"(replica {victim})" in e.value.details
        for sid in kept:
            K, _ = kvq.fetch(sid)
            assert np.array_equal(K, keys[sid])

        each = kvq.attend_each(1, queries)
        for i, sid in enumerate(ids):
            if sid in lost:
                assert isinstance(each[i], KvqError)
                assert each[i].code == grpc.StatusCode.UNAVAILABLE
            else:
                assert np.array_equal(each[i][0], before[i][0])
                assert np.array_equal(each[i][1], before[i][1])
        with pytest.raises(KvqError) as e:
            kvq.attend(1, queries)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE

        for _ in range(2):  # The survivors' streams go on, step after step.
            out, lse, errors = session.step_batch_each(0, sids, kk, kk, qq)
            for j, sid in enumerate(sids):
                if sid in lost:
                    assert errors[j].code == grpc.StatusCode.UNAVAILABLE
                    assert not out[j].any()
                else:
                    assert errors[j] is None
        session.close()

        # New sequences land on the survivors, though the victim is listed.
        survivors = [addresses[0], addresses[2]]
        c0 = counts(kvq)
        for _ in range(30):
            sid = kvq.create_sequence(layout(), scheme="fp16").sequence_id
            assert kvq.replica_of(sid) in survivors
        c1 = counts(kvq)
        assert sum(c1[a] for a in survivors) == sum(c0[a] for a in survivors) + 30

        # DNS drops the victim: the survivors' sequences stay put.
        kvq.replica_set.set(survivors)
        for sid in kept:
            kvq.stats(sid)
        for sid in lost:
            with pytest.raises(KvqError) as e:
                kvq.stats(sid)
            assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_a_replica_added_later_still_finds_earlier_sequences(servers):
    addresses = [a for _, a in servers]
    rng = np.random.default_rng(2)
    with connect(addresses[:2]) as kvq:
        ids = []
        for _ in range(36):  # (2/3)^36: the new replica wins one of them.
            sid = kvq.create_sequence(layout(), scheme="fp16").sequence_id
            k = rng.standard_normal((LAYERS, HEADS, TOKENS, DIM)).astype(np.float32)
            kvq.append_prompt(sid, k, k)
            ids.append(sid)
        kvq.replica_set.set(addresses)
        assert any(kvq.replica_of(s) == addresses[2] for s in ids)
        n = len(ids)
        kk = rng.standard_normal((n, HEADS, DIM)).astype(np.float32)
        q = rng.standard_normal((n, QHEADS, DIM)).astype(np.float32)
        out, lse = kvq.append_attend_batch(0, ids, kk, kk, q)
        assert out.shape == (n, QHEADS, DIM) and lse.shape == (n, QHEADS)
        for sid in ids:
            assert kvq.replica_of(sid) != addresses[2]
            kvq.stats(sid)
        assert counts(kvq)[addresses[2]] == 0
