"""The vLLM connector's halves (KvqScheduler, KvqWorker) against a real
kvq-server, without vLLM: the recorded call sequence
(tests/python/data/vllm_trace.json) replayed with real paged KV tensors, and
the engine kept serving when kvq hangs, refuses connections or dies in the
middle of a load.

Needs torch and $KVQ_SERVER_BIN (ctest sets it)."""

import json
import os
import shutil
import subprocess
import socket
import sys
import tempfile
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.dirname(__file__))
from kvq_client import KvqClient  # noqa: E402
from kvq_client.circuit_breaker import BreakerState  # noqa: E402
from kvq_client import quantized_append  # noqa: E402
from kvq_client.vllm_events import Removed, Stored  # noqa: E402
from kvq_client.vllm_plan import TokenRange  # noqa: E402
from live_server import (CPU_SERVER, needs_server, running_server, server_fixture,  # noqa: E402
                         start_server)
from vllm_halves import (ANSWERED, LAYOUT, engine, new_request_output,  # noqa: E402
                         scheduler_output)
from vllm_trace_model import (BLOCK_SIZE, HEAD_DIM, KV_HEADS, layer_names,  # noqa: E402
                              run_worker_event, token_kv)

pytestmark = needs_server

TRACE = os.path.join(os.path.dirname(__file__), "data", "vllm_trace.json")
# --evict: a released sequence's pages stay as prefix cache.
SERVER_FLAGS = (*CPU_SERVER, "--evict")
address = server_fixture(*SERVER_FLAGS)


def check_kv(got_k, got_v, want_k, want_v, scheme):
    """fp16: the fp16 rounding, exactly. int8 (per-token-group scale): within
    1/254 of the values' range per step, rounded. kivi4: half a 4-bit step
    of the range (K spans 4.0, V 2.0), plus 1 % for the fp16 scale."""
    if scheme == "fp16":
        np.testing.assert_array_equal(got_k, want_k.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(got_v, want_v.astype(np.float16).astype(np.float32))
        return
    levels = 15 if scheme.startswith("kivi4") else 255
    assert np.abs(got_k - want_k).max() <= 4.0 / levels / 2 * 1.01 + 2e-3
    assert np.abs(got_v - want_v).max() <= 2.0 / levels / 2 * 1.01 + 2e-3
    assert np.abs(got_k - want_k).max() > 0  # The scheme did quantize.


def geometry_of(scheme):
    """The page geometry the worker quantizes `scheme` with; None where it
    sends dense (no native module, or no raw pages)."""
    native = quantized_append.native()
    if native is None:
        return None
    geometry = native.page_geometry(scheme, HEAD_DIM)
    return geometry if quantized_append.why_not_quantized(geometry, None) is None else None


def expected_wire_bytes(geometry, start, tokens):
    """Payload bytes of a save of `tokens` tokens onto `start` stored ones,
    every layer: raw pages for what quantized_append.split_for_pages pages,
    fp16 for the rest (all of it without the native module)."""
    token_bytes = KV_HEADS * HEAD_DIM * 2 * 2
    if geometry is None:
        return len(layer_names()) * tokens * token_bytes
    split = quantized_append.split_for_pages(geometry, start, tokens)
    pages = -(-split.paged // split.page_tokens) * KV_HEADS * split.page_bytes
    return len(layer_names()) * ((split.dense_head + split.dense_tail) * token_bytes + pages)


def slots_of(block_ids, positions):
    return [block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def ranges(rs):
    return [{"request_id": r.request_id, "begin": r.begin, "end": r.end,
             "block_ids": list(r.block_ids)} for r in rs]


@pytest.mark.parametrize("scheme", ["fp16", "int8", "kivi4:g32:r128"])
def test_replay_saves_prompts_and_loads_shared_and_preempted_prefixes(address, scheme):
    with open(TRACE) as f:
        trace = json.load(f)
    assert trace["model"]["layer_names"] == layer_names()
    namespace = f"halves-{scheme}"
    engines, tokens, prompts, last_load, loaded = {}, {}, {}, {}, {}
    planned_saves, wire_bytes = 0, 0
    quant = geometry_of(scheme)
    meta, forward = None, None
    for event in trace["events"]:
        call, name = event["call"], event.get("engine")
        if event["side"] == "engine":
            if call == "add_request":
                if name not in engines:
                    # A 1 MiB load buffer: loads go a few layers at a time.
                    # Lookups wait for their answer (the recording's did).
                    engines[name] = engine(address, namespace, scheme, event["num_blocks"],
                                           load_buffer_bytes=1 << 20, **ANSWERED)
                rid = event["request_id"]
                prompts[rid] = list(event["prompt_token_ids"])
                tokens[rid] = list(prompts[rid])
            elif call == "forward":
                forward = event
            continue
        scheduler, worker, cache = engines[name]
        if event["side"] == "worker":
            result = run_worker_event(worker, cache, meta, event, forward)
            if "returned" in event:
                assert sorted(result or []) == event["returned"], event
            continue
        rid = event.get("request_id")
        if call == "get_num_new_matched_tokens":
            # Saves commit in the background: what another engine saved is
            # found once it committed, which the recording's synchronous
            # saves had by then.
            for _, w, _ in engines.values():
                assert w.worker.drain(30)
            while len(tokens[rid]) < event["num_tokens"]:
                tokens[rid].append(1000 + len(tokens[rid]))
            got = scheduler.lookup(rid, prompts[rid], len(tokens[rid]),
                                   event["num_computed_tokens"])
            assert [got, False] == event["returned"], rid
        elif call == "update_state_after_alloc":
            scheduler.after_alloc(rid, tokens[rid], event["num_external_tokens"])
        elif call == "build_connector_meta":
            meta = scheduler.build(scheduler_output(event["scheduler_output"]))
            want = {k: [{f: v for f, v in r.items() if f != "sequence_id"} for r in rs]
                    for k, rs in event["returned"].items()}
            assert {"loads": ranges(meta.loads), "saves": ranges(meta.saves)} == want
            for r in meta.saves:
                planned_saves += r.end - r.begin
                wire_bytes += expected_wire_bytes(quant, r.begin, r.end - r.begin)
            for r in meta.loads + meta.saves:
                assert r.sequence_id == scheduler.planner.sequence_id(r.request_id)
                assert r.namespace == namespace
            last_load.update((r.request_id, r) for r in meta.loads)
        elif call == "request_finished":
            worker.worker.drain(30)
            prompt = prompts[rid]
            # kvq holds the whole prompt, every layer.
            with KvqClient(address, namespace=namespace) as kvq:
                K, V = kvq.fetch(scheduler.planner.sequence_id(rid), dtype="fp32")
            assert K.shape == (len(layer_names()), KV_HEADS, len(prompt), HEAD_DIM)
            for layer in (0, len(layer_names()) - 1):
                want_k, want_v = token_kv(layer, range(len(prompt)), prompt)
                check_kv(K[layer], V[layer], want_k, want_v, scheme)
            # What this engine loaded sits in its paged cache, every layer.
            r = last_load.get(rid)
            if r is not None:
                positions = range(r.begin, r.end)
                for layer, lname in enumerate(layer_names()):
                    got_k, got_v = cache.read(lname, slots_of(r.block_ids, positions))
                    want_k, want_v = token_kv(layer, positions, prompt[r.begin:r.end])
                    check_kv(got_k, got_v, want_k, want_v, scheme)
                loaded[rid] = (r.begin, r.end)
            scheduler.finished(rid)
        else:
            raise AssertionError(f"unknown scheduler call {call!r}")
    assert loaded == {"req-b": (0, 256), "req-c2": (0, 150)}
    counts = {}
    for scheduler, worker, _ in engines.values():
        worker.worker.drain(30)
        for d in (scheduler.counters.take(), worker.worker.counters.take()):
            for k, v in d.items():
                if isinstance(v, int):
                    counts[k] = counts.get(k, 0) + v
        scheduler.shutdown()
        worker.worker.shutdown()
    # 256 + 150 tokens loaded; every planned save committed.
    assert counts["tokens_loaded"] == 256 + 150
    assert counts["tokens_saved"] == planned_saves
    # Saves travel quantized where kvq's native module is installed: raw
    # pages made on the client, the rest dense fp16 (expected_wire_bytes).
    assert counts["bytes_saved"] == wire_bytes
    dense = planned_saves * len(layer_names()) * KV_HEADS * HEAD_DIM * 2 * 2
    if quant is not None and scheme != "fp16":
        assert wire_bytes < 0.61 * dense  # int8: 0.59, kivi4 (its fp16 window): 0.60.
    # Hits are counted at a request's first lookup: b's (c2's came back
    # after its preemption).
    assert counts["lookup_hits"] == 1 and counts["hit_tokens"] == 256
    assert counts.get("load_failures", 0) == 0 and counts.get("save_failures", 0) == 0


# ------------------------------------------------------------ failing safe


def prefill(scheduler, worker, cache, rid, prompt, block_ids):
    """One request through lookup, one prefill step and finish; returns the
    external hit and the load errors the worker reported."""
    hit = scheduler.lookup(rid, prompt, len(prompt), 0)
    scheduler.after_alloc(rid, prompt, hit or 0)
    meta = scheduler.build(new_request_output(rid, block_ids, hit or 0,
                                              len(prompt) - (hit or 0)))
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    slots = slots_of(block_ids, range(hit or 0, len(prompt)))
    for layer, name in enumerate(layer_names()):
        worker.wait_for_layer_load(name)
        cache.forward_layer(layer, name, slots, list(range(hit or 0, len(prompt))),
                            prompt[hit or 0:])
        worker.save_kv_layer(name, cache.views[name], None)
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    worker.get_finished({rid})
    worker.clear_connector_metadata()
    scheduler.finished(rid)
    return hit, errors


PROMPT = list(range(10, 300))
BLOCKS = list(range(1, 20))


def test_lookups_change_nothing_on_the_server_and_creation_waits_for_allocation(address):
    a_sched, a_worker, a_cache = engine(address, "probe", "int8", 64, **ANSWERED)
    assert prefill(a_sched, a_worker, a_cache, "a", PROMPT, BLOCKS) == (0, set())
    # a's sequence is released by the worker's send thread, after its commit.
    assert a_worker.worker.drain(30)
    with KvqClient(address) as kvq:
        before = kvq.stats()
        b_sched, b_worker, _ = engine(address, "probe", "int8", 64, **ANSWERED)
        hits = [b_sched.lookup(f"b{i}", PROMPT, len(PROMPT), 0) for i in range(20)]
        # int8 shares 32-token blocks: 9 whole ones of the 290 saved tokens.
        assert hits == [288] * 20
        assert b_sched.lookup("b0", PROMPT, len(PROMPT), 0) == 288  # Answered locally.
        after = kvq.stats()
        assert (after.sequences, after.used_bytes, after.pages_used) == \
            (before.sequences, before.used_bytes, before.pages_used)
        assert after == before
        # vLLM allocated b0's blocks: now its sequence is created, holding the
        # prefix the lookup announced, and the step loads it.
        b_sched.after_alloc("b0", PROMPT, 288)
        meta = b_sched.build(scheduler_output({
            "scheduled_new_reqs": [{"req_id": "b0", "block_ids": [BLOCKS],
                                    "num_computed_tokens": 288}],
            "scheduled_cached_reqs": {"req_ids": [], "resumed_req_ids": [], "new_block_ids": [],
                                      "num_computed_tokens": []},
            "num_scheduled_tokens": {"b0": len(PROMPT) - 288}}))
        assert [(r.begin, r.end) for r in meta.loads] == [(0, 288)]
        sid = meta.loads[0].sequence_id
        assert sid and kvq.stats().sequences == before.sequences + 1
        b_sched.shutdown()
        b_worker.worker.shutdown(timeout=1)
        a_sched.shutdown()
        a_worker.worker.shutdown(timeout=1)


def test_refused_connections_cost_nothing_and_open_the_breaker(tmp_path):
    with socket.socket() as s:  # Bound, then closed: nothing listens.
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    scheduler, worker, cache = engine(dead, "down", "int8", 64, breaker_failures=2,
                                      breaker_backoff_seconds=60, lookup_wait_seconds=5)
    for i in range(4):
        hit, errors = prefill(scheduler, worker, cache, f"r{i}", PROMPT, BLOCKS)
        assert hit == 0 and errors == set()  # Served, computing every token.
    # Two refusals opened the breaker; the next two lookups never called.
    assert scheduler.breaker.state == BreakerState.OPEN
    counts = scheduler.counters.take()
    assert counts["lookup_misses"] == 2 and counts["lookup_skipped"] == 2
    assert counts["breaker_opened"] == 1 and counts["breaker_state"] == int(BreakerState.OPEN)
    scheduler.shutdown()
    worker.worker.shutdown()


def test_a_hanging_kvq_never_blocks_the_scheduler_loop():
    # A listener that never answers: connections open, gRPC never hears back.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        scheduler, worker, cache = engine(address, "hang", "int8", 64,
                                          lookup_deadline_seconds=0.5,
                                          lookup_wait_seconds=0.0, breaker_failures=1,
                                          breaker_backoff_seconds=60)
        answers = []
        while True:  # vLLM's scheduler loop asks again each step.
            got = scheduler.lookup("r", PROMPT, len(PROMPT), 0)
            answers.append(got)
            if got is not None:
                break
            time.sleep(0.05)
        # "Ask again" until the probe's 0.5 s deadline ran out, then no hit.
        assert answers[0] is None and answers[-1] == 0 and len(answers) >= 3
        assert scheduler.breaker.state == BreakerState.OPEN
        # With the breaker open the next request is answered at once.
        assert scheduler.lookup("r2", PROMPT, len(PROMPT), 0) == 0
        assert scheduler.counters.take()["lookup_skipped"] == 1
        scheduler.shutdown()
        worker.worker.shutdown(timeout=1)


def test_a_hanging_kvq_costs_a_load_one_deadline_and_never_holds_a_save():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        scheduler, worker, cache = engine(address, "hang", "int8", 64, deadline_seconds=0.5,
                                          save_deadline_seconds=60, breaker_failures=1,
                                          breaker_backoff_seconds=60)
        scheduler.shutdown()
        w = worker.worker
        load = TokenRange("r", "s0123", 0, 64, BLOCKS, namespace="hang")
        save = TokenRange("q", "s4567", 0, 32, BLOCKS[4:], namespace="hang")
        # The save's Append never commits: wait_for_save does not wait for it.
        for layer, name in enumerate(layer_names()):
            w.save_layer(name, cache.views[name], [save])
        w.wait_for_save()
        assert not w.drain(0.2)  # Still in flight, the step is done.
        # The load's first fetch runs out its 0.5 s: the blocks go back to
        # vLLM, and the breaker opens.
        w.start_load([load])
        for name in layer_names():
            w.wait_for_layer(name)
        assert w.take_load_errors() == set(BLOCKS[:4])
        assert w.breaker.state == BreakerState.OPEN
        # The next load is refused at once.
        w.start_load([load])
        assert w.take_load_errors() == set(BLOCKS[:4])
        counts = w.counters.take()
        assert counts["load_failures"] == 2 and counts["rpc_failures"] == 1
        w.shutdown(timeout=1)


def test_the_lookups_of_one_step_share_one_wait():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        scheduler, worker, _ = engine(address, "budget", "int8", 64, lookup_wait_seconds=0.2,
                                      lookup_deadline_seconds=5)
        # The first new request spends the step's 0.2 s; the others of the
        # same step do not wait at all.
        assert [scheduler.lookup(f"r{i}", PROMPT, len(PROMPT), 0) for i in range(5)] == \
            [None] * 5
        assert scheduler._wait_left <= 0
        scheduler.build(scheduler_output({
            "scheduled_new_reqs": [], "num_scheduled_tokens": {},
            "scheduled_cached_reqs": {"req_ids": [], "resumed_req_ids": [],
                                      "new_block_ids": [], "num_computed_tokens": []}}))
        assert scheduler._wait_left == pytest.approx(0.2)  # A new step, a new budget.
        scheduler.shutdown()
        worker.worker.shutdown(timeout=1)


def test_a_kvq_killed_mid_load_reports_the_blocks_and_the_engine_recomputes():
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_server(os.path.join(tmp, "port"), *SERVER_FLAGS)
        try:
            a = engine(address, "killed", "int8", 64, **ANSWERED,
                       breaker_failures=1, breaker_backoff_seconds=60,
                       deadline_seconds=5, max_chunk_bytes=4096)
            prefill(*a, "a", PROMPT, BLOCKS)
            a[1].worker.drain(30)
            b_sched, b_worker, b_cache = engine(address, "killed", "int8", 64,
                                                **ANSWERED, breaker_failures=1,
                                                breaker_backoff_seconds=60, deadline_seconds=5,
                                                max_chunk_bytes=4096, load_buffer_bytes=1)
            hit = b_sched.lookup("b", PROMPT, len(PROMPT), 0)
            # The whole kvq blocks of a's prompt (int8: 32-token blocks).
            assert hit == 288
            b_sched.after_alloc("b", PROMPT, hit)
            meta = b_sched.build(scheduler_output({
                "scheduled_new_reqs": [{"req_id": "b", "block_ids": [BLOCKS],
                                        "num_computed_tokens": hit}],
                "scheduled_cached_reqs": {"req_ids": [], "resumed_req_ids": [],
                                          "new_block_ids": [], "num_computed_tokens": []},
                "num_scheduled_tokens": {"b": len(PROMPT) - hit}}))
            b_worker.bind_connector_metadata(meta)
            # Killed once the load has started: one layer a fetch (a 1-byte
            # buffer), so the first layers may arrive and the rest cannot.
            b_worker.start_load_kv(None)
            b_worker.wait_for_layer_load(layer_names()[0])
            proc.kill()
            proc.wait()
            for name in layer_names()[1:]:
                b_worker.wait_for_layer_load(name)
            b_worker.wait_for_save()
            errors = b_worker.get_block_ids_with_load_errors()
            # vLLM recomputes every block of the loaded range.
            assert errors == set(BLOCKS[:hit // BLOCK_SIZE])
            counts = b_worker.worker.counters.take()
            assert counts["load_failures"] == 1 and counts.get("tokens_loaded", 0) == 0
            assert b_worker.worker.breaker.state == BreakerState.OPEN
            # The next step's load is refused at once by the breaker.
            b_worker.start_load_kv(None)
            b_worker.wait_for_save()
            assert b_worker.get_block_ids_with_load_errors() == set(BLOCKS[:hit // BLOCK_SIZE])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for s, w, _ in (a, (b_sched, b_worker, None)):
            s.shutdown()
            w.worker.shutdown(timeout=1)


# ------------------------------------------------- production wiring


MAKE_CERTS = os.path.join(os.path.dirname(__file__), "..", "integration", "make_test_certs.sh")
TOKEN = "vllm-connector-test-token-0123456789"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl tool")
def test_two_replicas_with_mutual_tls_and_a_token_file_share_a_prefix(tmp_path):
    """The shipped deployment's shape: two replicas (kvq_targets), mutual TLS
    and a tenant token read from a file. Engine a saves a prompt; engine b,
    with its own scheduler and worker clients, finds and loads it: every
    channel sent each sequence to the same replica (no NOT_FOUND)."""
    subprocess.run([MAKE_CERTS, str(tmp_path)], check=True, capture_output=True)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"tenant=vllm token={TOKEN}\n")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    flags = ("--metrics_address=", "--capacity_bytes=268435456", "--backend=cpu", "--evict",
             f"--tls_cert={tmp_path}/server.pem", f"--tls_key={tmp_path}/server.key",
             f"--tls_client_ca={tmp_path}/ca.pem", f"--tokens_file={tokens}")
    with running_server(*flags) as r1, running_server(*flags) as r2:
        wiring = dict(tls_ca=f"{tmp_path}/ca.pem", tls_cert=f"{tmp_path}/client.pem",
                      tls_key=f"{tmp_path}/client.key", tls_server_name="localhost",
                      token_file=str(token_file), **ANSWERED)
        engines = [engine("", "tls", "int8", 64, targets=f"{r1},{r2}", **wiring)
                   for _ in range(2)]
        for e in engines:
            assert e[0]._settings.address == ""  # The replica list, not one address.
        assert prefill(*engines[0], "a", PROMPT, BLOCKS) == (0, set())
        engines[0][1].worker.drain(30)
        hit, errors = prefill(*engines[1], "b", PROMPT + [7, 8, 9], BLOCKS)
        assert hit == 288 and errors == set()
        counts = engines[1][1].worker.counters.take()
        assert counts["tokens_loaded"] == 288 and counts.get("rpc_failures", 0) == 0
        # A wrong token is refused (UNAUTHENTICATED): no hit, the request runs.
        bad = tmp_path / "bad-token"
        bad.write_text("not-the-token-0123456789\n")
        wrong = engine("", "tls", "int8", 64, targets=f"{r1},{r2}",
                       **{**wiring, "token_file": str(bad)})
        assert wrong[0].lookup("c", PROMPT, len(PROMPT), 0) == 0
        for s, w, _ in engines + [wrong]:
            w.worker.drain(30)
            s.shutdown()
            w.worker.shutdown()


# -------------------------------------------------- tensor parallelism


def tp_engine(address, namespace, world=2):
    """A scheduler and `world` workers, each rank holding KV_HEADS / world
    heads in its own paged cache (vLLM's per-layer view)."""
    from kvq_client.client import ModelLayout
    from kvq_client.vllm_scheduler import KvqScheduler
    from kvq_client.vllm_settings import KvqSettings
    from kvq_client.vllm_worker import KvqWorker
    heads = KV_HEADS // world
    layout = ModelLayout(len(layer_names()), heads, 14 // world, HEAD_DIM)
    s = KvqSettings(address=address, namespace=namespace, scheme="int8",
                    **ANSWERED)
    s.check()
    scheduler = KvqScheduler(s, layout, save=True, load=True, world_size=world)
    ranks = []
    for rank in range(world):
        worker = KvqWorker(s, layout, BLOCK_SIZE, rank=rank, world_size=world)
        views = {n: torch.zeros(64, BLOCK_SIZE, heads, 2 * HEAD_DIM,
                                dtype=torch.float16).permute(0, 2, 1, 3)
                 for n in layer_names()}
        worker.register_caches(views)
        ranks.append((worker, views))
    return scheduler, ranks


def tp_step(scheduler, ranks, rid, prompt, hit):
    scheduler.after_alloc(rid, prompt, hit)
    plan = scheduler.build(new_request_output(rid, BLOCKS, hit, len(prompt) - hit))
    heads = KV_HEADS // len(ranks)
    slots = torch.as_tensor(slots_of(BLOCKS, range(hit, len(prompt))))
    for rank, (worker, views) in enumerate(ranks):
        worker.start_load(plan.loads)
        for layer, name in enumerate(layer_names()):
            worker.wait_for_layer(name)
            k, v = token_kv(layer, range(hit, len(prompt)), prompt[hit:])
            part = slice(rank * heads, (rank + 1) * heads)
            rows = torch.from_numpy(np.concatenate([k[part], v[part]], -1)).transpose(0, 1)
            views[name][slots // BLOCK_SIZE, :, slots % BLOCK_SIZE] = rows.half()
            worker.save_layer(name, views[name], plan.saves)
        worker.wait_for_save()
        assert worker.take_load_errors() == set()
        assert worker.drain(30)
    return plan


def test_tensor_parallel_ranks_keep_their_own_heads_in_their_own_sequences(address):
    a, a_ranks = tp_engine(address, "tp")
    assert a.lookup("a", PROMPT, len(PROMPT), 0) == 0
    plan = tp_step(a, a_ranks, "a", PROMPT, 0)
    ids = plan.saves[0].sequence_id.split(",")
    assert len(ids) == 2
    # Each rank's sequence holds that rank's head, in the rank's namespace.
    for rank, sid in enumerate(ids):
        with KvqClient(address, namespace=f"tp:tp2-{rank}") as kvq:
            K, _ = kvq.fetch(sid, dtype="fp32")
        want_k, _ = token_kv(5, range(len(PROMPT)), PROMPT)
        assert K.shape == (len(layer_names()), 1, len(PROMPT), HEAD_DIM)
        assert np.abs(K[5] - want_k[rank:rank + 1]).max() <= 4.0 / 255 / 2 * 1.01 + 2e-3
    # Another engine finds the prefix on both ranks and each loads its head.
    b, b_ranks = tp_engine(address, "tp")
    assert b.lookup("b", PROMPT, len(PROMPT), 0) == 288
    tp_step(b, b_ranks, "b", PROMPT, 288)
    want_k, _ = token_kv(7, range(288), PROMPT[:288])
    for rank, (_, views) in enumerate(b_ranks):
        slots = torch.as_tensor(slots_of(BLOCKS, range(288)))
        got = views[layer_names()[7]][slots // BLOCK_SIZE, :, slots % BLOCK_SIZE]
        got_k = got.transpose(0, 1)[..., :HEAD_DIM].float().numpy()
        assert np.abs(got_k - want_k[rank:rank + 1]).max() <= 4.0 / 255 / 2 * 1.01 + 2e-3
    for s, ranks in ((a, a_ranks), (b, b_ranks)):
        s.shutdown()
        for w, _ in ranks:
            w.shutdown()


def test_generated_tokens_are_found_by_the_next_turn(address):
    """Multi-turn reuse: engine a prefills 64 tokens and generates 40; the
    first 32 generated go to kvq with their ids. Engine b's prompt (the
    conversation so far plus a new message) finds 96 tokens: the prompt and
    the generated block."""
    a_sched, a_worker, a_cache = engine(address, "turns", "int8", 64, **ANSWERED,
                                        save_decode_tokens=32)
    prompt = list(range(500, 564))
    tokens = list(prompt)
    assert a_sched.lookup("a", prompt, len(prompt), 0) == 0
    a_sched.after_alloc("a", tokens, 0)

    def step(new, computed, scheduled):
        j = {"scheduled_new_reqs": [{"req_id": "a", "block_ids": [BLOCKS],
                                     "num_computed_tokens": computed}] if new else [],
             "scheduled_cached_reqs": {"req_ids": [] if new else ["a"], "resumed_req_ids": [],
                                       "new_block_ids": [] if new else [None],
                                       "num_computed_tokens": [] if new else [computed]},
             "num_scheduled_tokens": {"a": scheduled}}
        meta = a_sched.build(scheduler_output(j))
        a_worker.bind_connector_metadata(meta)
        a_worker.start_load_kv(None)
        positions = list(range(computed, computed + scheduled))
        for layer, name in enumerate(layer_names()):
            a_worker.wait_for_layer_load(name)
            a_cache.forward_layer(layer, name, slots_of(BLOCKS, positions), positions,
                                  tokens[computed:computed + scheduled])
            a_worker.save_kv_layer(name, a_cache.views[name], None)
        a_worker.wait_for_save()
        return meta.saves

    saves = step(True, 0, 64)
    for i in range(40):  # Each decode step computes the token sampled last.
        tokens.append(7000 + i)
        saves += step(False, 64 + i, 1)
    assert [(r.begin, r.end, r.token_ids) for r in saves] == \
        [(0, 64, []), (64, 96, tokens[64:96])]
    assert a_worker.worker.drain(30)
    assert a_worker.worker.counters.take().get("save_failures", 0) == 0
    b_sched, b_worker, _ = engine(address, "turns", "int8", 64, **ANSWERED)
    turn2 = tokens[:100] + list(range(9000, 9020))
    assert b_sched.lookup("b", turn2, len(turn2), 0) == 96
    for s, w in ((a_sched, a_worker), (b_sched, b_worker)):
        s.shutdown()
        w.worker.shutdown()


# ------------------------------------------------------------- KV events


def chain_hashes(tokens):
    """Chained per-block hashes standing in for vLLM's block hashes."""
    hashes, parent = [], None
    for i in range(len(tokens) // BLOCK_SIZE):
        parent = hash((parent, tuple(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])))
        hashes.append(parent)
    return hashes


def events_engine(address, namespace, **settings):
    from kvq_client.vllm_events import BlockLedger
    ledger = BlockLedger(BLOCK_SIZE, expect_release=settings.get("release_on_finish", True))
    return engine(address, namespace, "int8", 64, ledger=ledger, **ANSWERED,
                  **settings)


def prefill_step(scheduler, worker, cache, rid, prompt):
    """A request's lookup (with its block hashes) and one prefill step; the
    step's plan."""
    hit = scheduler.lookup(rid, prompt, len(prompt), 0, block_hashes=chain_hashes(prompt))
    scheduler.after_alloc(rid, prompt, hit)
    return scheduler.build(new_request_output(rid, BLOCKS, hit, len(prompt) - hit))


def run_step(worker, cache, meta, prompt):
    begin = meta.saves[0].begin if meta.saves else len(prompt)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    positions = list(range(begin, len(prompt)))
    for layer, name in enumerate(layer_names()):
        worker.wait_for_layer_load(name)
        cache.forward_layer(layer, name, slots_of(BLOCKS, positions), positions,
                            prompt[begin:])
        worker.save_kv_layer(name, cache.views[name], None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def deliver_reports(scheduler, worker):
    """What vLLM carries from the worker to the scheduler after a step."""
    assert worker.worker.drain(30)
    reports = worker.worker.take_reports()
    if reports is not None:
        scheduler.worker_reports(*reports)


def finish(scheduler, worker, rid):
    scheduler.finished(rid)
    worker.get_finished({rid})  # The next step: the worker releases.
    deliver_reports(scheduler, worker)
    scheduler.wait_for_probes(30)


def kvq_holds(address, namespace, prompt):
    with KvqClient(address, namespace=namespace) as kvq:
        return kvq.match_prefix(LAYOUT, scheme="int8",
                                prompt_token_ids=prompt).matched_tokens


HELD = 288  # int8's 32-token kvq blocks: 9 whole ones of PROMPT's 290 tokens.


@pytest.mark.parametrize("evict", [False, True])
def test_kv_events_announce_acknowledged_saves_and_take_back_released_prefixes(evict):
    """Stored only once the worker reported the commit, for the blocks kvq
    serves; after the release a probe asks kvq: without --evict the prefix
    went with the sequence (Removed), with --evict it stays (nothing)."""
    flags = SERVER_FLAGS if evict else tuple(f for f in SERVER_FLAGS if f != "--evict")
    hashes = chain_hashes(PROMPT)
    with running_server(*flags) as address:
        sched, worker, cache = events_engine(address, "ev")
        meta = prefill_step(sched, worker, cache, "a", PROMPT)
        assert [(r.begin, r.end) for r in meta.saves] == [(0, len(PROMPT))]
        assert sched.take_events() == []  # Planned, not yet committed.
        run_step(worker, cache, meta, PROMPT)
        deliver_reports(sched, worker)
        assert sched.take_events() == [Stored("a", hashes[:HELD // BLOCK_SIZE], None,
                                              PROMPT[:HELD], None)]
        assert kvq_holds(address, "ev", PROMPT) == HELD
        finish(sched, worker, "a")
        if evict:
            assert sched.take_events() == []
            assert kvq_holds(address, "ev", PROMPT) == HELD
        else:
            assert sched.take_events() == [Removed(hashes[:HELD // BLOCK_SIZE])]
            assert kvq_holds(address, "ev", PROMPT) == 0
        assert sched.take_events() == []
        sched.shutdown()
        worker.worker.shutdown()


def test_kv_events_never_announce_a_failed_save(address):
    sched, worker, cache = events_engine(address, "ev-fail")
    meta = prefill_step(sched, worker, cache, "a", PROMPT)
    # The sequence goes away before the worker's Append (as if evicted).
    with KvqClient(address, namespace="ev-fail") as kvq:
        kvq.release(meta.saves[0].sequence_id)
    run_step(worker, cache, meta, PROMPT)
    deliver_reports(sched, worker)
    assert worker.worker.counters.take().get("save_failures") == 1
    assert sched.take_events() == []
    assert kvq_holds(address, "ev-fail", PROMPT) == 0
    sched.shutdown()
    worker.worker.shutdown()


def test_kv_events_take_back_an_expired_prefix_when_a_lookup_misses_it(address):
    """Lease expiry (no release): kvq tells nobody; the next lookup of a
    prompt covering the announced blocks finds none and takes them back."""
    sched, worker, cache = events_engine(address, "ev-ttl", ttl_seconds=1,
                                         release_on_finish=False)
    hashes = chain_hashes(PROMPT)
    run_step(worker, cache, prefill_step(sched, worker, cache, "a", PROMPT), PROMPT)
    deliver_reports(sched, worker)
    assert [e.block_hashes for e in sched.take_events()] == [hashes[:HELD // BLOCK_SIZE]]
    finish(sched, worker, "a")
    give_up = time.monotonic() + 60  # The server's reaper runs every second.
    while kvq_holds(address, "ev-ttl", PROMPT) and time.monotonic() < give_up:
        time.sleep(0.2)
    assert kvq_holds(address, "ev-ttl", PROMPT) == 0
    assert sched.take_events() == []  # Nothing learned yet.
    assert sched.lookup("b", PROMPT, len(PROMPT), 0, block_hashes=hashes) == 0
    assert sched.take_events() == [Removed(hashes[:HELD // BLOCK_SIZE])]
    sched.shutdown()
    worker.worker.shutdown()


def test_kv_events_reset_takes_back_every_announced_block(address):
    sched, worker, cache = events_engine(address, "ev-reset")
    hashes = chain_hashes(PROMPT)
    run_step(worker, cache, prefill_step(sched, worker, cache, "a", PROMPT), PROMPT)
    deliver_reports(sched, worker)
    sched.take_events()
    assert sched.reset()
    assert sched.take_events() == [Removed(hashes[:HELD // BLOCK_SIZE])]
    sched.shutdown()
    worker.worker.shutdown()


def test_kv_events_audit_takes_back_a_released_prefix_kvq_evicts_later():
    """--evict keeps a released prefix as cache until the pool needs its
    pages: the release probe finds it; once other sequences fill the pool
    and kvq evicts it, the next audit probe takes it back."""
    from kvq_client.vllm_events import BlockLedger
    flags = tuple(f for f in SERVER_FLAGS if not f.startswith("--capacity_bytes")) + \
        ("--capacity_bytes=4194304",)
    hashes = chain_hashes(PROMPT)
    with running_server(*flags) as address:
        ledger = BlockLedger(BLOCK_SIZE, audit_prefixes=8)
        sched, worker, cache = engine(address, "ev-audit", "int8", 64, ledger=ledger,
                                      events_audit_seconds=0.001, **ANSWERED)
        run_step(worker, cache, prefill_step(sched, worker, cache, "a", PROMPT), PROMPT)
        deliver_reports(sched, worker)
        assert len(sched.take_events()) == 1
        finish(sched, worker, "a")
        assert sched.take_events() == []  # Released, kept as prefix cache.
        sched.wait_for_probes(30)
        assert sched.take_events() == []  # The audit found it held.
        # Other sequences fill the 4 MiB pool: kvq evicts a's cached pages.
        rng = np.random.default_rng(3)
        with KvqClient(address, namespace="ev-audit-fill") as kvq:
            for i in range(20):
                if not kvq_holds(address, "ev-audit", PROMPT):
                    break
                kv = rng.standard_normal((len(layer_names()), KV_HEADS, 256, HEAD_DIM))
                kv = kv.astype(np.float16)
                sid = kvq.create_sequence(LAYOUT, scheme="int8").sequence_id
                kvq.append_prompt(sid, kv, kv)
        assert kvq_holds(address, "ev-audit", PROMPT) == 0
        sched.take_events()       # Starts the audit's probe...
        sched.wait_for_probes(30)
        assert sched.take_events() == [Removed(hashes[:HELD // BLOCK_SIZE])]
        sched.shutdown()
        worker.worker.shutdown()
