"""KvqConnector against vLLM's real connector interface and a recorded call
sequence (tests/python/data/vllm_trace.json, see record_vllm_trace.py).

Runs only where vllm imports (KVQ_WITH_VLLM=1 scripts/install_deps.sh); the
replay also needs a kvq-server binary ($KVQ_SERVER_BIN, ctest sets it).
"""

import inspect
import json
import os
import pickle
import sys
import tempfile
import time

import numpy as np
import pytest

vllm = pytest.importorskip("vllm", reason="vllm is not installed (KVQ_WITH_VLLM=1)")
torch = pytest.importorskip("torch")

from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import (CachedRequestData, NewRequestData,  # noqa: E402
                                       SchedulerOutput)
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)
from vllm.v1.request import Request  # noqa: E402

from kvq_client import KvqClient  # noqa: E402
from kvq_client.vllm_connector import KvqConnector, KvqConnectorMetadata  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from live_server import CPU_SERVER, server_fixture  # noqa: E402
from vllm_trace_model import (BLOCK_SIZE, HEAD_DIM, KV_HEADS, MODEL_CONFIG,  # noqa: E402
                              NUM_BLOCKS, PagedCache, layer_names, run_worker_event,
                              token_kv)

TRACE = os.path.join(os.path.dirname(__file__), "data", "vllm_trace.json")

# ------------------------------------------------------------- interface


def test_subclasses_the_real_base_class_with_its_signatures():
    assert issubclass(KvqConnector, KVConnectorBase_V1)
    assert issubclass(KvqConnectorMetadata, KVConnectorMetadata)
    assert not KvqConnector.__abstractmethods__
    abstract = KVConnectorBase_V1.__abstractmethods__
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
            "start_load_kv", "wait_for_layer_load", "save_kv_layer",
            "wait_for_save"} <= set(abstract)
    overridden = [n for n, f in vars(KvqConnector).items()
                  if callable(f) and not n.startswith("_") and hasattr(KVConnectorBase_V1, n)]
    assert set(abstract) <= set(overridden)
    for name in overridden + ["__init__"]:
        ours = inspect.signature(getattr(KvqConnector, name)).parameters
        theirs = inspect.signature(getattr(KVConnectorBase_V1, name)).parameters
        assert [(p.name, p.kind, p.default) for p in ours.values()] == \
               [(p.name, p.kind, p.default) for p in theirs.values()], name


def test_asks_for_piecewise_cuda_graphs_so_layer_saves_run():
    assert KvqConnector.requires_piecewise_for_cudagraph({}) is True


def test_is_a_best_effort_cache_for_vllms_preemption(model_dir):
    # vLLM's default for a producer is True (its hand-off must be delivered).
    config = vllm_config(model_dir, unreachable_address(), "delivery", "int8", "e")
    scheduler = KvqConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert config.kv_transfer_config.is_kv_producer
    assert scheduler.requires_kv_delivery is False
    scheduler.shutdown()


def test_sets_vllms_load_failure_policy_to_recompute_or_refuses(model_dir):
    # vLLM's default "fail" would fail a user's request on a kvq miss.
    config = vllm_config(model_dir, unreachable_address(), "policy", "int8", "e")
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"
    scheduler = KvqConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert config.kv_transfer_config.kv_load_failure_policy == "recompute"
    scheduler.shutdown()
    config = vllm_config(model_dir, unreachable_address(), "policy", "int8", "e",
                         extra={"kvq_failure_policy": "require"})
    with pytest.raises(ValueError, match='needs kv_load_failure_policy "recompute"'):
        KvqConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_stats_travel_through_vllms_stats_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    a = KvqConnector.build_kv_connector_stats({"tokens_loaded": 5, "load_seconds": [0.5]})
    b = KvqConnector.build_kv_connector_stats({"tokens_loaded": 7, "breaker_state": 1})
    assert isinstance(a, KVConnectorStats) and not a.is_empty()
    merged = a.aggregate(b)
    assert merged.data["tokens_loaded"] == 12 and merged.data["breaker_state"] == 1
    assert merged.reduce()["load_ms_mean"] == 500.0


# ---------------------------------------------------------------- replay


# --evict: a released sequence's pages stay as prefix cache.
address = server_fixture(*CPU_SERVER, "--evict")


@pytest.fixture(scope="module")
def model_dir():
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(MODEL_CONFIG, f)
        yield tmp


def vllm_config(model_dir, address, namespace, scheme, engine_id, extra=None):
    return VllmConfig(
        model_config=ModelConfig(model=model_dir, dtype="float16", skip_tokenizer_init=True,
                                 seed=0),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128,
                                         max_model_len=4096, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvqConnector", kv_connector_module_path="kvq_client.vllm_connector",
            kv_role="kv_both", engine_id=engine_id,
            kv_connector_extra_config={"kvq_address": address, "kvq_namespace": namespace,
                                       "kvq_scheme": scheme, "kvq_lookup_wait_seconds": 10,
                                       "kvq_lookup_deadline_seconds": 10,
                                       **(extra or {})}),
        device_config=DeviceConfig("cpu"))


def kv_cache_config(num_blocks=NUM_BLOCKS):
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names(), FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
            dtype=torch.float16))])


def engine(model_dir, address, namespace, scheme, engine_id, num_blocks=NUM_BLOCKS,
           extra=None):
    """A scheduler-side and a worker-side connector of one vLLM engine, and
    the worker's paged cache, configured as the recording was."""
    config = vllm_config(model_dir, address, namespace, scheme, engine_id, extra)
    scheduler = KvqConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(num_blocks))
    worker = KvqConnector(config, KVConnectorRole.WORKER, kv_cache_config(num_blocks))
    cache = PagedCache(torch.float16, num_blocks)
    worker.register_kv_caches(cache.views)
    return scheduler, worker, cache


def _fields(cls):
    import dataclasses
    return {f.name for f in dataclasses.fields(cls)}


def scheduler_output(j, prompts):
    """vLLM's SchedulerOutput of a recorded step. Since 0.34 a resumed
    request comes back among the new requests with its whole block list
    (CachedRequestData has no resumed_req_ids): a recorded resumed request
    is moved there."""
    c = j["scheduled_cached_reqs"]
    resumed_as_new = "resumed_req_ids" not in _fields(CachedRequestData)
    new_items = [(n["req_id"], n["block_ids"], n["num_computed_tokens"])
                 for n in j["scheduled_new_reqs"]]
    cached_idx = list(range(len(c["req_ids"])))
    if resumed_as_new:
        new_items += [(c["req_ids"][i], c["new_block_ids"][i], c["num_computed_tokens"][i])
                      for i in cached_idx if c["req_ids"][i] in c["resumed_req_ids"]]
        cached_idx = [i for i in cached_idx if c["req_ids"][i] not in c["resumed_req_ids"]]
    extra = {"prefill_token_ids": None} if "prefill_token_ids" in _fields(NewRequestData) else {}
    new = []
    for rid, blocks, computed in new_items:
        if extra:
            extra["prefill_token_ids"] = prompts[rid]
        new.append(NewRequestData(req_id=rid, prompt_token_ids=prompts[rid], mm_features=[],
                                  sampling_params=None, pooling_params=None,
                                  block_ids=tuple(blocks), num_computed_tokens=computed,
                                  lora_request=None, **extra))
    ids = [c["req_ids"][i] for i in cached_idx]
    cached_args = dict(
        req_ids=ids, new_token_ids=[[] for _ in ids],
        new_block_ids=[None if c["new_block_ids"][i] is None else tuple(c["new_block_ids"][i])
                       for i in cached_idx],
        num_computed_tokens=[c["num_computed_tokens"][i] for i in cached_idx],
        num_output_tokens=[0] * len(ids))
    if not resumed_as_new:
        cached_args.update(resumed_req_ids=set(c["resumed_req_ids"]), all_token_ids={})
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(**cached_args),
        num_scheduled_tokens=j["num_scheduled_tokens"],
        total_num_scheduled_tokens=sum(j["num_scheduled_tokens"].values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
        finished_req_ids=set(j["finished_req_ids"]), free_encoder_mm_hashes=[],
        has_sync_kv_loads=j["has_sync_kv_loads"])


def ranges(rs):
    return [{"request_id": r.request_id, "begin": r.begin, "end": r.end,
             "block_ids": list(r.block_ids)} for r in rs]


def slots_of(block_ids, positions):
    return [block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def check_kv(got_k, got_v, want_k, want_v, exact):
    """fp16: the fp16 rounding of the model's values, exactly. kivi4 (4-bit,
    groups of 32 with fp16 scale and zero): within half a quantization step
    of each value's range (K spans 4.0, V 2.0: steps 4/15 and 2/15), plus 1%
    for the fp16 scale."""
    if exact:
        np.testing.assert_array_equal(got_k, want_k.astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(got_v, want_v.astype(np.float16).astype(np.float32))
    else:
        assert np.abs(got_k - want_k).max() <= 4.0 / 15 / 2 * 1.01
        assert np.abs(got_v - want_v).max() <= 2.0 / 15 / 2 * 1.01
        assert np.abs(got_k - want_k).max() > 0  # The scheme did quantize.


@pytest.mark.parametrize("scheme", ["fp16", "kivi4:g32:r128"])
def test_replay_saves_prompts_and_loads_shared_and_preempted_prefixes(
        address, model_dir, scheme):
    with open(TRACE) as f:
        trace = json.load(f)
    assert trace["model"]["layer_names"] == layer_names()
    namespace = f"replay-{scheme}"
    engines, requests, prompts, last_load, loaded = {}, {}, {}, {}, {}
    meta, forward = None, None
    for event in trace["events"]:
        call = event["call"]
        name = event.get("engine")
        if event["side"] == "engine":
            if call == "add_request":
                if name not in engines:
                    # A 1 MiB load buffer: loads go a few layers at a time
                    # (8 of 24 for 256 tokens, 13 then 11 for 150).
                    engines[name] = engine(model_dir, address, namespace, scheme, name,
                                           event["num_blocks"],
                                           extra={"kvq_load_buffer_bytes": 1 << 20})
                rid = event["request_id"]
                prompts[rid] = event["prompt_token_ids"]
                requests[rid] = Request(request_id=rid, prompt_token_ids=prompts[rid],
                                        sampling_params=SamplingParams(
                                            max_tokens=event["max_tokens"]),
                                        pooling_params=None)
            elif call == "forward":
                forward = event
            continue
        scheduler, worker, cache = engines[name]
        if event["side"] == "worker":
            result = run_worker_event(worker, cache, meta, event, forward)
            if "returned" in event:
                assert sorted(result) == event["returned"], event
            continue
        request = requests.get(event.get("request_id"))
        if call == "get_num_new_matched_tokens":
            # Saves commit in the background; the recording's were done by now.
            for _, w, _ in engines.values():
                assert w._worker.drain(30)
            # vLLM appends each sampled token to its Request (update_from_output).
            while request.num_tokens < event["num_tokens"]:
                request.append_output_token_ids(1000 + request.num_tokens)
            assert request.num_tokens == event["num_tokens"]
            got = scheduler.get_num_new_matched_tokens(request, event["num_computed_tokens"])
            assert list(got) == event["returned"], event["request_id"]
        elif call == "update_state_after_alloc":
            kv_blocks = KVCacheBlocks(tuple([KVCacheBlock(block_id=b) for b in group]
                                            for group in event["block_ids"]))
            scheduler.update_state_after_alloc(request, kv_blocks,
                                               event["num_external_tokens"])
        elif call == "build_connector_meta":
            meta = scheduler.build_connector_meta(
                scheduler_output(event["scheduler_output"], prompts))
            # Sequence ids are drawn (the recording's were named); the order
            # of requests within a step follows vLLM's lists.
            order = lambda rs: sorted(rs, key=lambda r: r["request_id"])  # noqa: E731
            want = {k: order([{f: v for f, v in r.items() if f != "sequence_id"} for r in rs])
                    for k, rs in event["returned"].items()}
            assert {"loads": order(ranges(meta.loads)),
                    "saves": order(ranges(meta.saves))} == want
            # vLLM pickles the scheduler output to its worker processes.
            meta = pickle.loads(pickle.dumps(meta))
            # A request's last load (earlier ones' blocks may have been
            # preempted and reused).
            last_load.update((r.request_id, r) for r in meta.loads)
        elif call == "request_finished":
            rid = event["request_id"]
            worker._worker.drain(30)
            prompt = prompts[rid]
            # kvq holds the whole prompt, every layer: the reused prefix
            # plus what this engine saved.
            with KvqClient(address, namespace=namespace) as kvq:
                K, V = kvq.fetch(scheduler._planner.sequence_id(rid), dtype="fp32")
            assert K.shape == (len(layer_names()), KV_HEADS, len(prompt), HEAD_DIM)
            for layer in (0, len(layer_names()) - 1):
                want_k, want_v = token_kv(layer, range(len(prompt)), prompt)
                check_kv(K[layer], V[layer], want_k, want_v, scheme == "fp16")
            # What this engine loaded sits in its paged cache, every layer.
            r = last_load.get(rid)
            if r is not None:
                positions = range(r.begin, r.end)
                for layer, lname in enumerate(layer_names()):
                    got_k, got_v = cache.read(lname, slots_of(r.block_ids, positions))
                    want_k, want_v = token_kv(layer, positions, prompt[r.begin:r.end])
                    check_kv(got_k, got_v, want_k, want_v, scheme == "fp16")
                loaded[rid] = (r.begin, r.end)
            assert list(scheduler.request_finished(request, event["block_ids"])) == \
                event["returned"]
        else:
            raise AssertionError(f"unknown scheduler call {call!r}")
    # engine-b loaded the 256-token prefix it shares with engine-a's prompt;
    # engine-c's preempted request loaded its own prompt back when resumed.
    assert loaded == {"req-b": (0, 256), "req-c2": (0, 150)}
    for scheduler, worker, _ in engines.values():
        scheduler.shutdown()
        worker.shutdown()


def unreachable_address():
    """A loopback port nothing listens on (bound, then closed)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_cache_salt_or_a_lora_gets_a_namespace_of_its_own(address, model_dir):
    scheduler, worker, _ = engine(model_dir, address, "salt", "fp16", "e")
    prompt = list(range(10, 300))
    salted = Request(request_id="salted", prompt_token_ids=prompt,
                     sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                     cache_salt="tenant-1")
    plain = Request(request_id="plain", prompt_token_ids=prompt,
                    sampling_params=SamplingParams(max_tokens=1), pooling_params=None)
    from vllm.lora.request import LoRARequest
    lora = Request(request_id="lora", prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                   lora_request=LoRARequest(lora_name="sql-adapter", lora_int_id=3,
                                              lora_path="/adapters/sql"))
    assert scheduler.get_num_new_matched_tokens(salted, 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(plain, 0) == (0, False)
    assert scheduler.get_num_new_matched_tokens(lora, 0) == (0, False)
    namespaces = scheduler._scheduler._namespaces
    assert namespaces["plain"] == "salt"
    assert namespaces["salted"].startswith("salt:salt-") and "tenant-1" not in namespaces["salted"]
    assert namespaces["lora"] == "salt:lora-sql-adapter"
    for r in (salted, plain, lora):
        scheduler.request_finished(r, [])
    scheduler.shutdown()
    worker.shutdown()


def test_unreachable_kvq_means_no_hit_and_no_saves(model_dir):
    scheduler, worker, _ = engine(model_dir, unreachable_address(), "down", "fp16", "e")
    request = Request(request_id="r", prompt_token_ids=list(range(10, 300)),
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None)
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, KVCacheBlocks(([],)), 0)
    meta = scheduler.build_connector_meta(scheduler_output({
        "scheduled_new_reqs": [{"req_id": "r", "prompt_token_ids": request.prompt_token_ids,
                                "block_ids": [list(range(19))], "num_computed_tokens": 0}],
        "scheduled_cached_reqs": {"req_ids": [], "resumed_req_ids": [], "new_block_ids": [],
                                  "num_computed_tokens": []},
        "num_scheduled_tokens": {"r": 290}, "finished_req_ids": [],
        "has_sync_kv_loads": False}, {"r": request.prompt_token_ids}))
    assert meta.loads == [] and meta.saves == []
    assert scheduler.request_finished(request, list(range(19))) == (False, None)
    scheduler.shutdown()
    worker.shutdown()


def test_a_silent_kvq_never_blocks_the_lookup(model_dir, caplog):
    # A listener that never answers: connections open, gRPC never hears back.
    import socket
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        config_address = f"127.0.0.1:{silent.getsockname()[1]}"
        scheduler, worker, _ = engine(model_dir, config_address, "silent", "fp16", "e",
                                      extra={"kvq_deadline_seconds": 3600,
                                             "kvq_lookup_deadline_seconds": 0.5,
                                             "kvq_lookup_wait_seconds": 0})
        request = Request(request_id="r", prompt_token_ids=list(range(10, 100)),
                          sampling_params=SamplingParams(max_tokens=1), pooling_params=None)
        with caplog.at_level("WARNING", logger="kvq_client.vllm_connector"):
            # vLLM's scheduler skips the request while the answer is None.
            assert scheduler.get_num_new_matched_tokens(request, 0) == (None, False)
            give_up = time.monotonic() + 30
            got = (None, False)
            while got[0] is None and time.monotonic() < give_up:
                time.sleep(0.05)
                got = scheduler.get_num_new_matched_tokens(request, 0)
        assert got == (0, False)
        # The lookup's 0.5 s ran out; with the worker's hour gRPC would
        # have given up on the connection instead (UNAVAILABLE).
        assert "lookup of request r failed (DEADLINE_EXCEEDED" in caplog.text
        assert not scheduler._planner.known("r")
        scheduler.shutdown()
        worker.shutdown()


def test_kv_events_announce_what_the_workers_report_committed_with_vllms_block_hashes(
        address, model_dir):
    """BlockStored once the worker's report of the commit reached the
    scheduler side (through vLLM's worker metadata, pickled as between
    processes), for the blocks kvq serves; the release probe finds the
    prefix kept (--evict) and removes nothing; reset_cache takes back
    every announced block (BlockRemoved)."""
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (get_request_block_hasher, init_none_hash,
                                             maybe_convert_block_hash)
    from vllm.v1.outputs import KVConnectorOutput
    init_none_hash(sha256)
    config = vllm_config(model_dir, address, "events", "fp16", "e")
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    scheduler = KvqConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    worker = KvqConnector(config, KVConnectorRole.WORKER, kv_cache_config())
    cache = PagedCache(torch.float16, NUM_BLOCKS)
    worker.register_kv_caches(cache.views)
    prompt = list(range(10, 60))  # 50 tokens: 3 whole vLLM blocks, 1 whole kvq block (32).
    request = Request(request_id="r", prompt_token_ids=prompt,
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
    assert len(request.block_hashes) == 3
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.update_state_after_alloc(request, KVCacheBlocks(([],)), 0)

    def step(computed, scheduled, new):
        j = {"scheduled_new_reqs": [{"req_id": "r", "block_ids": [[1, 2, 3, 4]],
                                     "num_computed_tokens": computed}] if new else [],
             "scheduled_cached_reqs": {"req_ids": [] if new else ["r"], "resumed_req_ids": [],
                                       "new_block_ids": [] if new else [None],
                                       "num_computed_tokens": [] if new else [computed]},
             "num_scheduled_tokens": {"r": scheduled}, "finished_req_ids": [],
             "has_sync_kv_loads": False}
        meta = scheduler.build_connector_meta(scheduler_output(j, {"r": prompt}))
        assert scheduler.take_events() == []  # Planned is not stored.
        worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        worker.start_load_kv(None)
        for name in layer_names():
            worker.wait_for_layer_load(name)
            worker.save_kv_layer(name, cache.views[name], None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        deliver()
        return scheduler.take_events()

    def deliver():
        assert worker._worker.drain(30)
        report = worker.build_connector_worker_meta()
        if report is not None:
            report = pickle.loads(pickle.dumps(report))
            scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=report))

    hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
    assert step(0, 20, True) == []  # 20 tokens: no whole kvq block yet.
    [stored] = step(20, 30, False)  # 50 tokens: kvq serves 32, vLLM blocks 0 and 1.
    assert isinstance(stored, BlockStored) and stored.medium == "kvq"
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids,
            stored.block_size) == (hashes[:2], None, prompt[:32], BLOCK_SIZE)
    with KvqClient(address, namespace="events") as kvq:
        assert kvq.match_prefix(scheduler._layout, scheme="fp16",
                                prompt_token_ids=prompt).matched_tokens == 32
    scheduler.request_finished(request, [1, 2, 3, 4])
    worker.get_finished({"r"})
    deliver()
    scheduler._scheduler.wait_for_probes(30)
    assert scheduler.take_events() == []  # --evict: the released prefix stays.
    assert scheduler.reset_cache() is True
    [removed] = scheduler.take_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == "kvq"
    assert removed.block_hashes == hashes[:2]
    scheduler.shutdown()
    worker.shutdown()


def test_kv_events_off_means_no_reports_and_no_events(address, model_dir):
    scheduler, worker, cache = engine(model_dir, address, "events-off", "fp16", "e")
    prompt = list(range(10, 60))
    request = Request(request_id="r", prompt_token_ids=prompt,
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None)
    scheduler.get_num_new_matched_tokens(request, 0)
    scheduler.update_state_after_alloc(request, KVCacheBlocks(([],)), 0)
    j = {"scheduled_new_reqs": [{"req_id": "r", "block_ids": [[1, 2, 3, 4]],
                                 "num_computed_tokens": 0}],
         "scheduled_cached_reqs": {"req_ids": [], "resumed_req_ids": [], "new_block_ids": [],
                                   "num_computed_tokens": []},
         "num_scheduled_tokens": {"r": 50}, "finished_req_ids": [], "has_sync_kv_loads": False}
    worker.bind_connector_metadata(scheduler.build_connector_meta(
        scheduler_output(j, {"r": prompt})))
    worker.start_load_kv(None)
    for name in layer_names():
        worker.save_kv_layer(name, cache.views[name], None)
    worker.wait_for_save()
    assert worker._worker.drain(30)
    assert worker.build_connector_worker_meta() is None
    assert scheduler.take_events() == []
    scheduler.shutdown()
    worker.shutdown()


def test_prometheus_metrics_count_what_the_stats_carry(model_dir):
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram
    config = vllm_config(model_dir, unreachable_address(), "prom", "int8", "e")
    prom = KvqConnector.build_prom_metrics(
        config, {Gauge: Gauge, Counter: Counter, Histogram: Histogram},
        ["model_name", "engine"], {0: ["m", "0"]})
    labels = {"model_name": "m", "engine": "0"}
    stats = KvqConnector.build_kv_connector_stats(
        {"tokens_loaded": 256, "bytes_saved": 1000, "load_failures": 1,
         "load_seconds": [0.02, 0.3], "breaker_state": 1})
    prom.observe(stats.to_dict(), 0)
    prom.observe({"tokens_loaded": 44, "breaker_state": 0}, 0)
    value = lambda name: REGISTRY.get_sample_value(name, labels)  # noqa: E731
    assert value("vllm:kvq_tokens_loaded_total") == 300
    assert value("vllm:kvq_bytes_saved_total") == 1000
    assert value("vllm:kvq_load_failures_total") == 1
    assert value("vllm:kvq_load_seconds_count") == 2
    assert value("vllm:kvq_load_seconds_sum") == pytest.approx(0.32)
    assert value("vllm:kvq_breaker_state") == 0  # The latest report.
