"""The vLLM connector's two halves (KvqScheduler, KvqWorker) driven without
vLLM: SchedulerOutput and Request stand-ins built from the recorded trace
(tests/python/data/vllm_trace.json), and a worker adapter with the
connector's method names for vllm_trace_model.run_worker_event."""

import types

from kvq_client.client import ModelLayout
from kvq_client.vllm_scheduler import KvqScheduler
from kvq_client.vllm_settings import KvqSettings
from kvq_client.vllm_worker import KvqWorker
from vllm_trace_model import BLOCK_SIZE, HEAD_DIM, KV_HEADS, LAYERS, Q_HEADS, PagedCache

LAYOUT = ModelLayout(LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM)

# Settings of an engine whose lookups wait for kvq's answer, however loaded
# the machine (the default 0.2 s MatchPrefix deadline would turn a slow
# answer into a miss).
ANSWERED = dict(lookup_wait_seconds=10, lookup_deadline_seconds=10)


def ns(**kw):
    return types.SimpleNamespace(**kw)


def scheduler_output(j):
    """A SchedulerOutput stand-in with the fields KvqScheduler.build reads."""
    new = [ns(req_id=n["req_id"], block_ids=tuple(n["block_ids"]),
              num_computed_tokens=n["num_computed_tokens"]) for n in j["scheduled_new_reqs"]]
    c = j["scheduled_cached_reqs"]
    cached = ns(req_ids=c["req_ids"], resumed_req_ids=set(c["resumed_req_ids"]),
                new_block_ids=[None if b is None else tuple(b) for b in c["new_block_ids"]],
                num_computed_tokens=c["num_computed_tokens"])
    return ns(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
              num_scheduled_tokens=j["num_scheduled_tokens"])


def new_request_output(request_id, block_ids, computed, scheduled):
    """The SchedulerOutput stand-in of a step that schedules one new request."""
    return scheduler_output({
        "scheduled_new_reqs": [{"req_id": request_id, "block_ids": [block_ids],
                                "num_computed_tokens": computed}],
        "scheduled_cached_reqs": {"req_ids": [], "resumed_req_ids": [], "new_block_ids": [],
                                  "num_computed_tokens": []},
        "num_scheduled_tokens": {request_id: scheduled}})


class WorkerAdapter:
    """KvqWorker behind the connector's worker-side method names."""

    def __init__(self, worker):
        self.worker = worker
        self.meta = None

    def handle_preemptions(self, meta):
        return None

    def bind_connector_metadata(self, meta):
        self.meta = meta

    def clear_connector_metadata(self):
        self.meta = None

    def start_load_kv(self, _forward_context):
        self.worker.start_load(self.meta.loads)

    def wait_for_layer_load(self, name):
        self.worker.wait_for_layer(name)

    def save_kv_layer(self, name, kv_layer, _attn_metadata):
        self.worker.save_layer(name, kv_layer, self.meta.saves)

    def wait_for_save(self):
        self.worker.wait_for_save()

    def get_finished(self, ids):
        self.worker.get_finished(ids)
        return None, None

    def get_block_ids_with_load_errors(self):
        return self.worker.take_load_errors()


def engine(address, namespace, scheme, num_blocks, dtype=None, ledger=None, **settings):
    """(KvqScheduler, WorkerAdapter, PagedCache) of one kv_both engine; with
    `ledger` (a vllm_events.BlockLedger) its KV events are on."""
    import torch
    s = KvqSettings(address=address, namespace=namespace, scheme=scheme, **settings)
    s.check()
    scheduler = KvqScheduler(s, LAYOUT, save=True, load=True, ledger=ledger)
    worker = KvqWorker(s, LAYOUT, BLOCK_SIZE)
    cache = PagedCache(dtype or torch.float16, num_blocks)
    worker.register_caches(cache.views)
    return scheduler, WorkerAdapter(worker), cache
