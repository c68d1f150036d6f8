"""Sharding over several kvq-server replicas, as the C++ ShardedKvqClient
(client/sharded_client.h) does, with the same hash: a C++ and a Python
worker that see the same replica list place every sequence alike.

Rendezvous (highest-random-weight) hashing: every replica scores each key,
the highest score wins; removing a replica moves only the keys it won,
adding one takes about 1/N of the keys for itself.

    hash64(b)       = mix64(FNV-1a 64 of b)
    mix64(z)        = SplitMix64's finalizer
    score(key, r)   = mix64(hash64(key) ^ hash64(r))  (ties: smaller name)
    sequence key    = namespace + b"\\0" + sequence id
    prefix key      = b"prefix\\0" + namespace + b"\\0" + first prefix_tokens
                      token ids as little-endian int32

A worker::

    from kvq_client import ShardedClient
    with ShardedClient(dns="kvq.tenant-a.svc.cluster.local:50051",
                       namespace="tenant-a") as kvq:
        seq = kvq.create_sequence(layout, prompt_token_ids=prompt)
        kvq.append_prompt(seq.sequence_id, k[:, :, seq.num_tokens:], v[:, :, seq.num_tokens:])
        results = kvq.attend_each(layer, queries)   # [(out, lse) or KvqError]
"""

import secrets
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from .client import AttendQuery, DecodeItem, KvqClient, KvqError, MatchResult, _ClosedOnExit

_M64 = (1 << 64) - 1


def fnv1a64(data: bytes) -> int:
    h = 0xcbf29ce484222325
    for c in data:
        h = ((h ^ c) * 0x100000001b3) & _M64
    return h


def mix64(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xbf58476d1ce4e5b9) & _M64
    z ^= z >> 27
    z = (z * 0x94d049bb133111eb) & _M64
    return z ^ (z >> 31)


def hash64(data: bytes) -> int:
    return mix64(fnv1a64(data))


def _b(s):
    return s.encode() if isinstance(s, str) else bytes(s)


def sequence_key(namespace, sequence_id) -> bytes:
    return _b(namespace) + b"\0" + _b(sequence_id)


def prefix_key(namespace, prompt_token_ids, prefix_tokens) -> bytes:
    ids = list(prompt_token_ids)[:max(prefix_tokens, 0)]
    return b"prefix\0" + _b(namespace) + b"\0" + struct.pack(f"<{len(ids)}i", *ids)


def ranking(key: bytes, replicas):
    """Indexes of `replicas`, best first."""
    h = hash64(key)
    scores = [mix64(h ^ hash64(_b(r))) for r in replicas]
    return sorted(range(len(replicas)), key=lambda i: (-scores[i], replicas[i]))


def winner(key: bytes, replicas):
    """Index of the key's winner; -1 for no replicas."""
    return ranking(key, replicas)[0] if replicas else -1


# ------------------------------------------------------------ replica set

def split_host_port(target):
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f'replica target "{target}" must be host:port')
    if not port.isdigit():
        raise ValueError(f'replica target "{target}" has a port that is not a number')
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f'replica target "{target}" opens [ without closing it')
        host = host[1:-1]
    return host, port


def resolve_with_getaddrinfo(host, port):
    """'IP:PORT' ('[v6]:PORT') of every TCP address of host."""
    out = []
    for family, _, _, _, addr in socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM):
        if family == socket.AF_INET:
            out.append(f"{addr[0]}:{port}")
        elif family == socket.AF_INET6:
            out.append(f"[{addr[0]}]:{port}")
    return out


class ReplicaSet:
    """The replicas: a fixed list, or a DNS name resolved now and every
    `refresh` seconds (a daemon thread). Sorted, unique; `version` grows
    on every change. A failed or empty resolution keeps the previous list."""

    def __init__(self, targets=None, dns=None, refresh=5.0, resolver=resolve_with_getaddrinfo):
        if (targets is None) == (dns is None):
            raise ValueError("give either targets or dns")
        self._lock = threading.Lock()
        self._replicas, self.version = (), 0
        self._host = self._port = None
        self._stop = threading.Event()
        self._resolver = resolver
        if dns is None:
            self.set(list(targets))
            return
        self._host, self._port = split_host_port(dns)
        self.refresh()
        if refresh and refresh > 0:
            threading.Thread(target=self._loop, args=(refresh,), daemon=True).start()

    @property
    def replicas(self):
        with self._lock:
            return self._replicas

    def snapshot(self):
        with self._lock:
            return self._replicas, self.version

    def set(self, replicas):
        names = sorted({r.strip() for r in replicas if r.strip()})
        if not names:
            raise ValueError("the replica list is empty")
        for r in names:
            split_host_port(r)
        with self._lock:
            if tuple(names) != self._replicas:
                self._replicas = tuple(names)
                self.version += 1

    def refresh(self):
        """Resolves now; raises (keeping the list) when that fails or finds nothing."""
        if self._host is None:
            return
        found = self._resolver(self._host, self._port)
        if not found:
            raise LookupError(f"{self._host}:{self._port} resolved to no address")
        self.set(found)

    def _loop(self, every):
        while not self._stop.wait(every):
            try:
                self.refresh()
            except (OSError, LookupError, ValueError):
                pass  # The previous list stays.

    def close(self):
        self._stop.set()


# ---------------------------------------------------------- sharded client

class ShardedClient:
    """KvqClient's calls over the replicas of a ReplicaSet, each sequence on
    the replica its id wins. New ids are drawn by the client so that their
    winner is the replica wanted: with prompt_token_ids of at least
    prefix_tokens tokens, the winner of the prompt's prefix key (prompts that
    share a prefix meet, and the server reuses it); otherwise uniform. A
    replica that answers UNAVAILABLE gets no new sequences for
    down_cooldown seconds. After NOT_FOUND a call looks for the sequence on
    the other replicas (a replica added since it was created), remembers
    where and repeats once. Batched calls are split per replica, sent
    concurrently and merged in order; the *_each forms give each item its
    own result or KvqError. Thread-safe."""

    def __init__(self, targets=None, dns=None, namespace="", deadline=30.0, retry=None,
                 prefix_tokens=32, down_cooldown=5.0, probe_deadline=2.0, refresh=5.0,
                 replica_set=None, id_seed=None, **client_kwargs):
        self._own_set = replica_set is None
        if replica_set is None:
            if isinstance(targets, str):
                targets = [t for t in targets.split(",") if t.strip()]
            replica_set = ReplicaSet(targets=targets, dns=dns, refresh=refresh)
        self.replica_set = replica_set
        self.namespace = namespace
        self.prefix_tokens = prefix_tokens
        self.down_cooldown = down_cooldown
        self.probe_deadline = probe_deadline
        self._client_args = dict(namespace=namespace, deadline=deadline, retry=retry,
                                 **client_kwargs)
        self._lock = threading.Lock()
        self._clients, self._clients_version = {}, 0
        self._moved, self._down_until = {}, {}
        self._ids = (lambda: secrets.token_hex(8)) if id_seed is None else self._seeded(id_seed)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvq-shard")

    @staticmethod
    def _seeded(seed):
        import random
        rng, lock = random.Random(seed), threading.Lock()

        def draw():
            with lock:
                return f"{rng.getrandbits(64):016x}"
        return draw

    def close(self):
        self._pool.shutdown(wait=True)
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()
        if self._own_set:  # A caller's set may serve others: theirs to stop.
            self.replica_set.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------- placement

    def client_for_replica(self, replica):
        replicas, version = self.replica_set.snapshot()
        with self._lock:
            if version != self._clients_version:
                for name in [n for n in self._clients if n not in replicas]:
                    self._clients.pop(name).close()
                self._clients_version = version
            c = self._clients.get(replica)
            if c is None:
                c = self._clients[replica] = KvqClient(replica, **self._client_args)
            return c

    def replica_of(self, sequence_id):
        """Where the sequence is: where a NOT_FOUND found it, else its id's winner."""
        replicas = self.replica_set.replicas
        key = sequence_key(self.namespace, sequence_id)
        with self._lock:
            moved = self._moved.get(key)
        if moved in replicas:
            return moved
        return replicas[winner(key, replicas)]

    def client_for(self, sequence_id):
        """The KvqClient of the sequence's replica (e.g. for a decode_session)."""
        return self.client_for_replica(self.replica_of(sequence_id))

    def _new_id(self):
        return "s" + self._ids()

    def _draw_id_for(self, replicas, target):
        for _ in range(64 * len(replicas)):
            sid = self._new_id()
            if replicas[winner(sequence_key(self.namespace, sid), replicas)] == target:
                return sid
        raise KvqError(grpc.StatusCode.INTERNAL, f"no id drawn wins replica {target}")

    def _note(self, replica, error):
        if isinstance(error, KvqError) and error.code == grpc.StatusCode.UNAVAILABLE:
            with self._lock:
                self._down_until[replica] = time.monotonic() + self.down_cooldown

    def _is_down(self, replica):
        with self._lock:
            return self._down_until.get(replica, 0) > time.monotonic()

    @staticmethod
    def _on_replica(error, replica):
        return KvqError(error.code, f"{error.details} (replica {replica})")

    def _relocate(self, sequence_id, tried):
        replicas = self.replica_set.replicas
        key = sequence_key(self.namespace, sequence_id)
        for i in ranking(key, replicas):
            r = replicas[i]
            if r == tried or self._is_down(r):
                continue
            try:
                self.client_for_replica(r).stats(sequence_id, deadline=self.probe_deadline)
            except KvqError as e:
                self._note(r, e)
                continue
            with self._lock:
                if len(self._moved) >= 1 << 16:
                    self._moved.clear()
                self._moved[key] = r
            return True
        return False

    def _on_owner(self, sequence_id, fn):
        replica = self.replica_of(sequence_id)
        try:
            return fn(self.client_for_replica(replica))
        except KvqError as e:
            self._note(replica, e)
            if e.code != grpc.StatusCode.NOT_FOUND or not self._relocate(sequence_id, replica):
                raise self._on_replica(e, replica) from None
        replica = self.replica_of(sequence_id)
        try:
            return fn(self.client_for_replica(replica))
        except KvqError as e:
            self._note(replica, e)
            raise self._on_replica(e, replica) from None

    def _for_each_replica(self, ids, run):
        """run(client, indexes) -> results for those indexes, per replica,
        concurrently; returns one result or KvqError per id."""
        results = [None] * len(ids)

        def one_pass(indexes):
            groups = {}
            for i in indexes:
                groups.setdefault(self.replica_of(ids[i]), []).append(i)
            futures = {r: self._pool.submit(run, self.client_for_replica(r), idx)
                       for r, idx in groups.items()}
            failed = {}
            for r, idx in groups.items():
                try:
                    for i, value in zip(idx, futures[r].result()):
                        results[i] = value
                except KvqError as e:
                    self._note(r, e)
                    err = self._on_replica(_renumber(e, idx), r)
                    for i in idx:
                        results[i] = err
                    failed[r] = (e, idx)
            return failed

        again = []
        for r, (e, idx) in one_pass(range(len(ids))).items():
            if e.code != grpc.StatusCode.NOT_FOUND:
                continue
            present, moved = [], False
            for i in idx:
                try:
                    self.client_for_replica(r).stats(ids[i], deadline=self.probe_deadline)
                    present.append(i)
                except KvqError:
                    if self._relocate(ids[i], r):
                        present.append(i)
                        moved = True
                    else:
                        results[i] = KvqError(grpc.StatusCode.NOT_FOUND,
                                              f"items[{i}].sequence: {ids[i]} is on none of "
                                              "the replicas")
            if moved or len(present) < len(idx):
                again.extend(present)
        if again:
            one_pass(sorted(again))
        return results

    # ---------------------------------------------------------------- RPCs

    def info(self, deadline=None):
        """ServerInfo of the first replica that answers."""
        last = KvqError(grpc.StatusCode.FAILED_PRECONDITION, "no replicas")
        for r in self.replica_set.replicas:
            try:
                return self.client_for_replica(r).info(deadline=deadline)
            except KvqError as e:
                self._note(r, e)
                last = self._on_replica(e, r)
        raise last

    def create_sequence(self, layout, scheme="kivi4:g32:r128:sink=4", sequence_id="",
                        prompt_token_ids=None, **kwargs):
        """As KvqClient.create_sequence, placed as the class says. A
        caller-chosen sequence_id is placed by its own hash."""
        prompt = list(prompt_token_ids or [])
        if sequence_id:
            return self._on_owner(sequence_id, lambda c: c.create_sequence(
                layout, scheme, sequence_id, prompt_token_ids=prompt, **kwargs))
        replicas = self.replica_set.replicas
        pkey = self._prefix_key(prompt)
        last = None
        for _ in replicas:
            sid = self._new_id()
            target = self._first_up(pkey or sequence_key(self.namespace, sid), replicas)
            if replicas[winner(sequence_key(self.namespace, sid), replicas)] != target:
                sid = self._draw_id_for(replicas, target)
            try:
                return self.client_for_replica(target).create_sequence(
                    layout, scheme, sid, prompt_token_ids=prompt, **kwargs)
            except KvqError as e:
                self._note(target, e)
                last = self._on_replica(e, target)
                if e.code != grpc.StatusCode.UNAVAILABLE:
                    raise last from None
        raise last

    def _prefix_key(self, prompt):
        """The key that places a prompt's sequence, None where placement is
        uniform (prompt shorter than prefix_tokens)."""
        if 0 < self.prefix_tokens <= len(prompt):
            return prefix_key(self.namespace, prompt, self.prefix_tokens)
        return None

    def _first_up(self, key, replicas):
        order = ranking(key, replicas)
        return next((replicas[i] for i in order if not self._is_down(replicas[i])),
                    replicas[order[0]])

    def match_prefix(self, layout, scheme="kivi4:g32:r128:sink=4", prompt_token_ids=None,
                     **kwargs):
        """As KvqClient.match_prefix (read-only), asked of the replica that
        create_sequence would place this prompt on: the prefix's winner,
        where shared prefixes meet. A prompt placed uniformly (shorter than
        prefix_tokens) over several replicas has no predictable replica:
        MatchResult(0, 0) without a call."""
        prompt = list(prompt_token_ids or [])
        replicas = self.replica_set.replicas
        if not replicas:
            raise KvqError(grpc.StatusCode.FAILED_PRECONDITION, "no replicas")
        pkey = self._prefix_key(prompt)
        if pkey is None:
            if len(replicas) > 1:
                return MatchResult(0, 0)
            pkey = b""
        target = self._first_up(pkey, replicas)
        try:
            return self.client_for_replica(target).match_prefix(
                layout, scheme, prompt_token_ids=prompt, **kwargs)
        except KvqError as e:
            self._note(target, e)
            raise self._on_replica(e, target) from None

    def append_prompt(self, sequence_id, k, v, **kwargs):
        return self._on_owner(sequence_id, lambda c: c.append_prompt(sequence_id, k, v, **kwargs))

    def fetch(self, sequence_id, **kwargs):
        return self._on_owner(sequence_id, lambda c: c.fetch(sequence_id, **kwargs))

    def stats(self, sequence_id, deadline=None):
        """Stats of one sequence (server-wide: stats_all)."""
        if not sequence_id:
            raise ValueError("sequence_id is empty: server-wide stats are per replica (stats_all)")
        return self._on_owner(sequence_id, lambda c: c.stats(sequence_id, deadline=deadline))

    def stats_all(self, deadline=None):
        """{replica: StatsResponse or KvqError} of every current replica."""
        out = {}
        for r in self.replica_set.replicas:
            try:
                out[r] = self.client_for_replica(r).stats("", deadline=deadline)
            except KvqError as e:
                self._note(r, e)
                out[r] = self._on_replica(e, r)
        return out

    def release(self, sequence_id, deadline=None):
        freed = self._on_owner(sequence_id, lambda c: c.release(sequence_id, deadline=deadline))
        with self._lock:
            self._moved.pop(sequence_key(self.namespace, sequence_id), None)
        return freed

    def fork(self, sequence_id, new_sequence_id="", **kwargs):
        """The fork stays on the source's replica (its id drawn to win there)."""
        replica = self.replica_of(sequence_id)
        replicas = self.replica_set.replicas
        if not new_sequence_id:
            new_sequence_id = self._draw_id_for(replicas, replica)
        else:
            w = replicas[winner(sequence_key(self.namespace, new_sequence_id), replicas)]
            if w != replica:
                raise ValueError(f'new_sequence_id "{new_sequence_id}" is placed on replica {w}, '
                                 f"not on {replica} where the source is; leave it empty")
        try:
            return self.client_for_replica(replica).fork(sequence_id, new_sequence_id, **kwargs)
        except KvqError as e:
            self._note(replica, e)
            raise self._on_replica(e, replica) from None

    def decode_session(self, deadline=None):
        """A ShardedDecodeSession: one decode stream per replica behind one session."""
        return ShardedDecodeSession(self, deadline)

    def attend_each(self, layer, items, softmax_scale=0.0, deadline=None):
        """[(out, lse) or KvqError] per AttendQuery, in order."""
        items = [it if isinstance(it, AttendQuery) else AttendQuery(*it) for it in items]
        return self._for_each_replica(
            [it.sequence_id for it in items],
            lambda c, idx: c.attend(layer, [items[i] for i in idx], softmax_scale, deadline))

    def attend(self, layer, items, softmax_scale=0.0, deadline=None):
        return _all_or_raise(self.attend_each(layer, items, softmax_scale, deadline))

    def append_attend_each(self, layer, items, softmax_scale=0.0, deadline=None):
        items = [it if isinstance(it, DecodeItem) else DecodeItem(*it) for it in items]
        return self._for_each_replica(
            [it.sequence_id for it in items],
            lambda c, idx: c.append_attend(layer, [items[i] for i in idx], softmax_scale,
                                           deadline))

    def append_attend(self, layer, items, softmax_scale=0.0, deadline=None):
        return _all_or_raise(self.append_attend_each(layer, items, softmax_scale, deadline))

    def attend_batch_each(self, layer, sequence_ids, q, softmax_scale=0.0, key_end=0,
                          deadline=None):
        """(out, lse, errors): packed results, rows of failed items zero, and
        errors[i] a KvqError or None."""
        ids, q = list(sequence_ids), np.asarray(q)

        def run(c, idx):
            out, lse = c.attend_batch(layer, [ids[i] for i in idx], q[idx], softmax_scale,
                                      key_end, deadline)
            return list(zip(out, lse))
        return _packed(self._for_each_replica(ids, run))

    def attend_batch(self, layer, sequence_ids, q, softmax_scale=0.0, key_end=0, deadline=None):
        out, lse, errors = self.attend_batch_each(layer, sequence_ids, q, softmax_scale, key_end,
                                                  deadline)
        _raise_first(errors)
        return out, lse

    def append_attend_batch_each(self, layer, sequence_ids, k, v, q, softmax_scale=0.0,
                                 deadline=None):
        ids = list(sequence_ids)
        k, v, q = np.asarray(k), np.asarray(v), np.asarray(q)

        def run(c, idx):
            out, lse = c.append_attend_batch(layer, [ids[i] for i in idx], k[idx], v[idx],
                                             q[idx], softmax_scale, deadline)
            return list(zip(out, lse))
        return _packed(self._for_each_replica(ids, run))

    def append_attend_batch(self, layer, sequence_ids, k, v, q, softmax_scale=0.0,
                            deadline=None):
        out, lse, errors = self.append_attend_batch_each(layer, sequence_ids, k, v, q,
                                                         softmax_scale, deadline)
        _raise_first(errors)
        return out, lse


class ShardedDecodeSession(_ClosedOnExit):
    """Decode streams over several replicas: a step's items are split by
    replica, each part written to that replica's stream (opened on first
    use) and the results merged in order. A stream ends at its first failed
    step, so a failed replica's items get its KvqError and its stream is
    dropped (its next items open a fresh one) while the other streams go on.
    The *_each forms give each item its result or KvqError; the plain forms
    raise the first failure. Steps may be pipelined. Not thread-safe."""

    def __init__(self, sharded, deadline=None):
        self._sharded, self._deadline = sharded, deadline
        self._sessions, self._pending = {}, []

    def _session(self, replica):
        s = self._sessions.get(replica)
        if s is None:
            s = self._sessions[replica] = \
                self._sharded.client_for_replica(replica).decode_session(self._deadline)
        return s

    def _drop(self, replica, session):
        if self._sessions.get(replica) is session:
            del self._sessions[replica]
            session.cancel()

    def _write(self, ids, write_part, packed):
        groups = {}
        for i, sid in enumerate(ids):
            groups.setdefault(self._sharded.replica_of(sid), []).append(i)
        parts = []
        for replica, idx in groups.items():
            session = self._session(replica)
            try:
                write_part(session, idx)
                parts.append((replica, idx, session, None))
            except KvqError as e:
                self._drop(replica, session)
                parts.append((replica, idx, None, self._sharded._on_replica(_renumber(e, idx),
                                                                            replica)))
        self._pending.append((packed, len(ids), parts))

    def _read(self, packed):
        if not self._pending:
            raise KvqError(grpc.StatusCode.FAILED_PRECONDITION, "no step written to read")
        if self._pending[0][0] != packed:
            raise KvqError(grpc.StatusCode.FAILED_PRECONDITION,
                           "the next step was written with the other form (write / write_batch)")
        _, n, parts = self._pending.pop(0)
        results = [None] * n
        for replica, idx, session, error in parts:
            if error is None:
                try:
                    if packed:
                        out, lse = session.read_batch()
                        got = list(zip(out, lse))
                    else:
                        got = session.read()
                    for i, r in zip(idx, got):
                        results[i] = r
                    continue
                except KvqError as e:
                    self._drop(replica, session)
                    error = self._sharded._on_replica(_renumber(e, idx), replica)
            for i in idx:
                results[i] = error
        return results

    def write(self, layer, items, softmax_scale=0.0):
        items = [it if isinstance(it, DecodeItem) else DecodeItem(*it) for it in items]
        if not items:
            raise ValueError("items is empty")
        self._write([it.sequence_id for it in items],
                    lambda s, idx: s.write(layer, [items[i] for i in idx], softmax_scale), False)

    def read_each(self):
        return self._read(False)

    def read(self):
        return _all_or_raise(self.read_each())

    def step_each(self, layer, items, softmax_scale=0.0):
        self.write(layer, items, softmax_scale)
        return self.read_each()

    def step(self, layer, items, softmax_scale=0.0):
        self.write(layer, items, softmax_scale)
        return self.read()

    def write_batch(self, layer, sequence_ids, k, v, q, softmax_scale=0.0):
        ids = list(sequence_ids)
        k, v, q = np.asarray(k), np.asarray(v), np.asarray(q)
        for name, a in (("k", k), ("v", v), ("q", q)):
            if a.ndim != 3 or not ids or a.shape[0] != len(ids):
                raise ValueError(f"{name} must be [{len(ids)} sequences (at least one), heads, "
                                 f"head_dim], got {a.shape}")
        self._write(ids, lambda s, idx: s.write_batch(layer, [ids[i] for i in idx], k[idx],
                                                      v[idx], q[idx], softmax_scale), True)

    def read_batch_each(self):
        """(out, lse, errors) as ShardedClient.append_attend_batch_each."""
        return _packed(self._read(True))

    def read_batch(self):
        out, lse, errors = self.read_batch_each()
        _raise_first(errors)
        return out, lse

    def step_batch_each(self, layer, sequence_ids, k, v, q, softmax_scale=0.0):
        self.write_batch(layer, sequence_ids, k, v, q, softmax_scale)
        return self.read_batch_each()

    def step_batch(self, layer, sequence_ids, k, v, q, softmax_scale=0.0):
        self.write_batch(layer, sequence_ids, k, v, q, softmax_scale)
        return self.read_batch()

    def close(self):
        """Closes every stream; raises the first failure."""
        sessions, self._sessions, self._pending = self._sessions, {}, []
        first = None
        for replica, s in sessions.items():
            try:
                s.close()
            except KvqError as e:
                first = first or self._sharded._on_replica(e, replica)
        if first is not None:
            raise first

    def cancel(self):
        for s in self._sessions.values():
            s.cancel()
        self._sessions, self._pending = {}, []


def _renumber(error, indexes):
    """items[j] in a replica's message about its part -> items[indexes[j]]."""
    import re

    def sub(m):
        j = int(m.group(1))
        return f"items[{indexes[j]}]" if j < len(indexes) else m.group(0)
    return KvqError(error.code, re.sub(r"items\[(\d+)\]", sub, error.details))


def _all_or_raise(results):
    _raise_first([r if isinstance(r, KvqError) else None for r in results])
    return results


def _raise_first(errors):
    for e in errors:
        if e is not None:
            raise e


def _packed(results):
    good = next((r for r in results if not isinstance(r, KvqError)), None)
    errors = [r if isinstance(r, KvqError) else None for r in results]
    if good is None:
        return None, None, errors
    out = np.zeros((len(results),) + good[0].shape, good[0].dtype)
    lse = np.zeros((len(results),) + good[1].shape, good[1].dtype)
    for i, r in enumerate(results):
        if errors[i] is None:
            out[i], lse[i] = r
    return out, lse, errors
