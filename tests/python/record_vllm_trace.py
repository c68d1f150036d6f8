"""Records tests/python/data/vllm_trace.json: the connector calls two vLLM
engines make for two requests that share a prompt prefix.

Needs vllm (KVQ_WITH_VLLM=1 scripts/install_deps.sh) and a kvq-server binary:

    KVQ_SERVER_BIN=build/service/kvq-server python3 tests/python/record_vllm_trace.py

The scheduler side is vLLM's own: its real Scheduler (with its real
KVCacheManager, prefix cache and chunked prefill) runs the requests with
KvqConnector as its connector and a live kvq-server behind it; every call it
makes into the connector is logged with its arguments and results. No model
runs (no GPU here), so the worker side is reconstructed from vLLM's model
runner code (vllm/v1/worker/gpu/kv_connector.py and
model_executor/layers/attention/kv_transfer_utils.py): per step
handle_preemptions, bind_connector_metadata, start_load_kv (before the
forward when the step has synchronous loads), per attention layer
wait_for_layer_load and save_kv_layer after the layer wrote its slots,
wait_for_save, get_finished, get_block_ids_with_load_errors,
clear_connector_metadata. The slots a layer writes are the ones vLLM's
model runner computes: block_ids[pos // block_size] * block_size +
pos % block_size for each scheduled position.

Engine engine-a (kv_both) serves a 300-token prompt in chunks of at most 128
tokens and decodes 3 tokens; engine engine-b (kv_both, separate scheduler and
cache) then serves a prompt sharing A's first 270 tokens; engine engine-c
serves two 150-token prompts at once in a cache too small for both to decode
24 tokens, with vLLM's own prefix cache off, so vLLM preempts one and resumes
it later, loading its prompt back from kvq.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvq_client.vllm_connector import KvqConnector  # noqa: E402
from vllm_trace_model import (BLOCK_SIZE, EVENTS, HEAD_DIM, KV_HEADS, LAYERS,  # noqa: E402
                              MODEL_CONFIG, NUM_BLOCKS, PREEMPT_BLOCKS, PagedCache, SCHEME,
                              layer_names,
                              run_worker_event)

OUT = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "data", "vllm_trace.json")


def new_data(n):
    return {"req_id": n.req_id, "prompt_token_ids": list(n.prompt_token_ids or []),
            "block_ids": [list(b) for b in n.block_ids],
            "num_computed_tokens": n.num_computed_tokens}


def scheduler_output_json(so):
    c = so.scheduled_cached_reqs
    return {
        "scheduled_new_reqs": [new_data(n) for n in so.scheduled_new_reqs],
        "scheduled_cached_reqs": {
            # vLLM 0.34 sends a resumed request among the new ones.
            "req_ids": list(c.req_ids),
            "resumed_req_ids": sorted(getattr(c, "resumed_req_ids", None) or ()),
            "new_block_ids": [None if b is None else [list(x) for x in b]
                              for b in c.new_block_ids],
            "num_computed_tokens": list(c.num_computed_tokens)},
        "num_scheduled_tokens": dict(so.num_scheduled_tokens),
        "finished_req_ids": sorted(so.finished_req_ids),
        "has_sync_kv_loads": bool(so.has_sync_kv_loads),
    }


def ranges_json(ranges):
    # Sequence ids are drawn by the client (random): not recorded.
    return [{"request_id": r.request_id, "begin": r.begin, "end": r.end,
             "block_ids": list(r.block_ids)} for r in ranges]


class RecordingKvqConnector(KvqConnector):
    """KvqConnector that logs each scheduler-side call vLLM makes."""

    def _log(self, event):
        EVENTS.append({"side": "scheduler", "engine": self._kv_transfer_config.engine_id,
                       **event})

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        result = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._log({"call": "get_num_new_matched_tokens",
                   "request_id": request.request_id,
                   "prompt_token_ids": list(request.prompt_token_ids),
                   "num_tokens": request.num_tokens,
                   "num_computed_tokens": num_computed_tokens, "returned": list(result)})
        return result

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._log({"call": "update_state_after_alloc",
                   "request_id": request.request_id,
                   "block_ids": [list(b) for b in blocks.get_block_ids()],
                   "num_external_tokens": num_external_tokens})
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        self._log({"call": "build_connector_meta",
                   "scheduler_output": scheduler_output_json(scheduler_output),
                   "returned": {"loads": ranges_json(meta.loads),
                                "saves": ranges_json(meta.saves)}})
        return meta

    def request_finished(self, request, block_ids):
        result = super().request_finished(request, block_ids)
        self._log({"call": "request_finished",
                   "request_id": request.request_id, "block_ids": list(block_ids),
                   "returned": [result[0], result[1]]})
        return result


def worker_step(engine, so):
    """The step's forward (the slots vLLM's model runner computes for each
    scheduled position) and the worker-side calls vLLM's model runner makes
    for it, in order."""
    blocks = {n.req_id: n for n in so.scheduled_new_reqs}
    slots, positions, tokens = [], [], []
    for rid, num in so.num_scheduled_tokens.items():
        state = RUNNING[engine][rid]
        if rid in blocks:
            state["block_ids"] = list(blocks[rid].block_ids[0])
            state["computed"] = blocks[rid].num_computed_tokens
        else:
            c = so.scheduled_cached_reqs
            i = c.req_ids.index(rid)
            if rid in (getattr(c, "resumed_req_ids", None) or ()):
                state["block_ids"] = list(c.new_block_ids[i][0])
            elif c.new_block_ids[i] is not None:
                state["block_ids"].extend(c.new_block_ids[i][0])
            state["computed"] = c.num_computed_tokens[i]
        for pos in range(state["computed"], state["computed"] + num):
            slots.append(state["block_ids"][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            positions.append(pos)
            tokens.append(state["tokens"][pos])
    forward = {"slot_mapping": slots, "positions": positions, "token_ids": tokens}
    w = {"side": "worker", "engine": engine}
    calls = [dict(w, call="handle_preemptions"), dict(w, call="bind_connector_metadata")]
    if so.has_sync_kv_loads:
        calls.append(dict(w, call="start_load_kv"))
    if slots:  # A step without scheduled tokens runs no forward.
        for name in layer_names():
            calls.append(dict(w, call="wait_for_layer_load", layer_name=name))
            calls.append(dict(w, call="save_kv_layer", layer_name=name))
    if not so.has_sync_kv_loads:
        calls.append(dict(w, call="start_load_kv"))
    calls += [dict(w, call="wait_for_save"),
              dict(w, call="get_finished", finished_req_ids=sorted(so.finished_req_ids)),
              dict(w, call="get_block_ids_with_load_errors"),
              dict(w, call="clear_connector_metadata")]
    return forward, calls


def run_worker(engine, so, worker, cache):
    forward, calls = worker_step(engine, so)
    EVENTS.append({"side": "engine", "engine": engine, "call": "forward", **forward})
    for call in calls:
        result = run_worker_event(worker, cache, so.kv_connector_metadata, call, forward)
        if call["call"] == "get_block_ids_with_load_errors":
            call["returned"] = sorted(result)
            if result:
                raise RuntimeError(f"engine {engine}: kvq load failed for blocks {result}")
        EVENTS.append(call)
    # Saves commit in the background; waiting for them here makes the
    # recording deterministic (a later lookup finds what was saved).
    worker._worker.drain(30)


RUNNING = {}  # engine -> request id -> {"tokens", "block_ids", "computed"}, as its worker sees it.


def make_config(address, engine_id, model_dir, prefix_caching=True):
    model = ModelConfig(model=model_dir, dtype="float16", skip_tokenizer_init=True, seed=0)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=4096,
                            enable_chunked_prefill=True, is_encoder_decoder=False)
    cache = CacheConfig(block_size=BLOCK_SIZE, gpu_memory_utilization=0.9,
                        enable_prefix_caching=prefix_caching)
    transfer = KVTransferConfig(
        kv_connector="RecordingKvqConnector", kv_connector_module_path="record_vllm_trace",
        kv_role="kv_both", engine_id=engine_id,
        kv_connector_extra_config={"kvq_address": address, "kvq_namespace": "trace",
                                   "kvq_scheme": SCHEME,
                                   # Lookups wait for their answer, however
                                   # loaded the machine (deterministic).
                                   "kvq_lookup_wait_seconds": 10,
                                   "kvq_lookup_deadline_seconds": 10})
    return VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                      kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))


def run_engine(engine, config, requests, num_blocks=NUM_BLOCKS):
    """Runs `requests` [(request_id, prompt, max_tokens)], all added at once,
    to completion on a fresh engine of `num_blocks` cache blocks."""
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names(), FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
            dtype=torch.float16))])
    config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=False,
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK_SIZE)
    worker = KvqConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    cache = PagedCache(torch.float16, num_blocks)
    worker.register_kv_caches(cache.views)
    RUNNING[engine] = {}
    for request_id, prompt, max_tokens in requests:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(request_id=request_id, prompt_token_ids=prompt,
                          sampling_params=params, pooling_params=None,
                          block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))
        RUNNING[engine][request_id] = {"tokens": list(prompt)}
        EVENTS.append({"side": "engine", "engine": engine, "call": "add_request",
                       "request_id": request_id, "prompt_token_ids": list(prompt),
                       "max_tokens": max_tokens, "num_blocks": num_blocks})
        scheduler.add_request(request)
    for step in range(64):  # Bounded: these requests need at most a few dozen steps.
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        EVENTS.append({"side": "engine", "engine": engine, "call": "step", "step": step})
        run_worker(engine, so, worker, cache)
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            state = RUNNING[engine][rid]
            done = state["computed"] + so.num_scheduled_tokens[rid]
            # A token is sampled once the prompt is complete (chunks before it
            # sample nothing vLLM keeps).
            if done >= len(state["tokens"]):
                token = 1000 + len(state["tokens"])
                state["tokens"].append(token)
                sampled.append([token])
            else:
                sampled.append([])
        extra = ({"req_id_to_index": {r: i for i, r in enumerate(ids)}}
                 if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
                 else {})  # vLLM < 0.34.
        out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, **extra)
        scheduler.update_from_output(so, out)
    else:
        raise RuntimeError("the engine did not finish in 64 steps")
    # The step after the last one carries the finished id to the workers.
    so = scheduler.schedule()
    EVENTS.append({"side": "engine", "engine": engine, "call": "step", "step": "final"})
    run_worker(engine, so, worker, cache)
    worker.shutdown()


def main():
    server = os.environ.get("KVQ_SERVER_BIN", "")
    if not os.access(server, os.X_OK):
        sys.exit("set KVQ_SERVER_BIN to a kvq-server binary")
    init_none_hash(sha256)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(MODEL_CONFIG, f)
        port_file = os.path.join(tmp, "port")
        proc = subprocess.Popen([server, "--address=127.0.0.1:0", "--metrics_address=127.0.0.1:0",
                                 f"--port_file={port_file}", "--capacity_bytes=268435456",
                                 "--backend=cpu", "--evict"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port, give_up = 0, time.monotonic() + 60
            while not port and time.monotonic() < give_up and proc.poll() is None:
                time.sleep(0.05)
                try:
                    port = int(open(port_file).read().strip() or 0)
                except (OSError, ValueError):
                    port = 0
            if not port:
                sys.exit("kvq-server did not start")
            address = f"127.0.0.1:{port}"
            prompt_a = [(7 * i + 3) % 5000 + 10 for i in range(300)]
            prompt_b = prompt_a[:270] + [(11 * i + 5) % 5000 + 10 for i in range(50)]
            run_engine("engine-a", make_config(address, "engine-a", tmp),
                       [("req-a", prompt_a, 3)])
            run_engine("engine-b", make_config(address, "engine-b", tmp),
                       [("req-b", prompt_b, 2)])
            # Two requests that outgrow a small cache while decoding: vLLM
            # preempts one, then resumes it. vLLM's own prefix cache is off,
            # so the resumed request loads its prompt back from kvq.
            prompt_c1 = [(13 * i + 1) % 5000 + 10 for i in range(150)]
            prompt_c2 = [(17 * i + 2) % 5000 + 10 for i in range(150)]
            run_engine("engine-c", make_config(address, "engine-c", tmp, prefix_caching=False),
                       [("req-c1", prompt_c1, 24), ("req-c2", prompt_c2, 24)],
                       num_blocks=PREEMPT_BLOCKS)
        finally:
            proc.terminate()
            proc.wait()
    trace = {
        "vllm_version": vllm.__version__,
        "provenance": ("scheduler-side calls recorded from vLLM's real Scheduler driving "
                       "KvqConnector against a live kvq-server; worker-side calls "
                       "reconstructed from vLLM's model-runner code (no model ran)"),
        "model": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                  "block_size": BLOCK_SIZE, "num_blocks": NUM_BLOCKS, "scheme": SCHEME,
                  "layer_names": layer_names(), "config": MODEL_CONFIG},
        "events": EVENTS,
    }
    with open(OUT, "w") as f:
        json.dump(trace, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT}: {len(EVENTS)} events")


if __name__ == "__main__":
    main()
