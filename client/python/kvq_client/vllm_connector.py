"""KvqConnector: kvq as a vLLM V1 KV-transfer connector (see docs/VLLM.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvqConnector",
        "kv_connector_module_path": "kvq_client.vllm_connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvq_dns": "kvq.kvq.svc.cluster.local:50051"}}'

This module adapts vLLM's KVConnectorBase_V1 to the two halves that do the
work without vLLM: KvqScheduler (vllm_scheduler.py: read-only lookups off
the scheduler loop, sequences created after allocation, per-step plans) and KvqWorker (vllm_worker.py: layer-wise
asynchronous loads, saves committed in the background). It adds what only
vLLM has: its request objects, the tensor-parallel rank, the load-failure
policy, the connector's stats and Prometheus metrics, and KV events with
vLLM's block hashes (announced and taken back by vllm_events.BlockLedger,
from the workers' reports carried as vLLM's worker metadata).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorRole)

from .client import ModelLayout
from .vllm_events import BlockLedger, Removed, Stored, scheme_sink
from .vllm_plan import TokenRange
from .vllm_scheduler import KvqScheduler
from .vllm_settings import DEFAULT_SCHEME, KvqSettings, apply_failure_policy  # noqa: F401
from .vllm_stats import COUNTS, SAMPLES, ConnectorCounters, is_empty, merge, reduce
from .vllm_worker import KvqWorker, layer_order  # noqa: F401

try:  # KV events for KV-aware routers, acknowledged by the workers (vLLM >= 0.34).
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
except ImportError:  # pragma: no cover
    BlockRemoved = BlockStored = KVConnectorWorkerMetadata = maybe_convert_block_hash = None

try:  # vLLM's stats and Prometheus hooks (absent from older releases).
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                       KVConnectorStats)
except ImportError:  # pragma: no cover
    KVConnectorStats = KVConnectorPromMetrics = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass
class KvqConnectorMetadata(KVConnectorMetadata):
    loads: List[TokenRange] = field(default_factory=list)
    saves: List[TokenRange] = field(default_factory=list)


if KVConnectorWorkerMetadata is not None:

    @dataclass
    class KvqWorkerMetadata(KVConnectorWorkerMetadata):
        """A worker's reports (vllm_worker.WorkerReports) of one step, to the
        scheduler side; vLLM sums them over tensor-parallel workers."""
        saved: Dict[str, int] = field(default_factory=dict)
        failed: Dict[str, int] = field(default_factory=dict)
        released: Dict[str, int] = field(default_factory=dict)

        def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
            def add(a, b):
                out = dict(a)
                for k, n in b.items():
                    out[k] = out.get(k, 0) + n
                return out
            return KvqWorkerMetadata(add(self.saved, other.saved),
                                     add(self.failed, other.failed),
                                     add(self.released, other.released))


def kv_events_enabled(vllm_config: "VllmConfig") -> bool:
    """Whether vLLM publishes KV events (--kv-events-config), and this vLLM
    carries the workers' reports the connector's events wait for."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and getattr(events, "enable_kv_cache_events", False) and
                KVConnectorWorkerMetadata is not None)


def model_layout(vllm_config: "VllmConfig") -> ModelLayout:
    """kvq's layout of one tensor-parallel rank's share of the model (its KV
    heads); pipeline parallelism is refused."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("KvqConnector supports pipeline_parallel_size 1, got "
                         f"{parallel.pipeline_parallel_size}")
    m = vllm_config.model_config
    return ModelLayout(m.get_num_layers(parallel), m.get_num_kv_heads(parallel),
                       m.get_num_attention_heads(parallel), m.get_head_size())


def keyed_by_tokens_alone(request: "Request") -> bool:
    """Whether the prompt's token ids (with the cache salt and LoRA, which
    the connector folds into the namespace) determine its KV: images do not
    (their placeholder ids stand for any image), so such requests bypass."""
    return not getattr(request, "mm_features", None)


def lora_name(request: "Request") -> Optional[str]:
    lora = getattr(request, "lora_request", None)
    return None if lora is None else str(getattr(lora, "lora_name", None) or
                                         getattr(lora, "lora_int_id", ""))


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except (ImportError, AssertionError, RuntimeError):
        return 0  # No model-parallel group (a single process, tests).


class KvqConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._settings = KvqSettings.from_extra_config(
            dict(transfer.kv_connector_extra_config or {}), vllm_config.model_config.model)
        apply_failure_policy(transfer, self._settings)
        self._layout = model_layout(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        world = vllm_config.parallel_config.tensor_parallel_size
        self._counters = ConnectorCounters()
        self._scheduler: Optional[KvqScheduler] = None
        self._worker: Optional[KvqWorker] = None
        self._events = kv_events_enabled(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            ledger = BlockLedger(self._block_size, world, scheme_sink(self._settings.scheme),
                                 expect_release=self._settings.release_on_finish,
                                 audit_prefixes=self._settings.events_audit_prefixes) \
                if self._events else None
            self._scheduler = KvqScheduler(self._settings, self._layout,
                                           save=transfer.is_kv_producer,
                                           load=transfer.is_kv_consumer, world_size=world,
                                           counters=self._counters, ledger=ledger)
        else:
            self._worker = KvqWorker(self._settings, self._layout, self._block_size,
                                     rank=_tp_rank(), world_size=world,
                                     counters=self._counters, reports=self._events)

    @property
    def requires_kv_delivery(self) -> bool:
        # kvq is a best-effort cache: a save dropped by a preemption is a
        # later miss, never a reason for vLLM to recompute the request.
        return False

    @property
    def _planner(self):
        return self._scheduler.planner

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # wait_for_layer_load and save_kv_layer run in every attention layer:
        # a full CUDA graph replay would skip them.
        return True

    # ------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        lora = getattr(request, "lora_request", None)
        n = self._scheduler.lookup(
            request.request_id, request.prompt_token_ids or [], request.num_tokens,
            num_computed_tokens, cache_salt=getattr(request, "cache_salt", None),
            lora_name=lora_name(request), keyed_by_tokens=keyed_by_tokens_alone(request),
            block_hashes=getattr(request, "block_hashes", None) or None,
            event_extra=(getattr(lora, "adapter_id", None), getattr(lora, "name", None))
            if lora else None)
        return n, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        self._scheduler.after_alloc(request.request_id, request.all_token_ids,
                                    num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        plan = self._scheduler.build(scheduler_output)
        return KvqConnectorMetadata(loads=plan.loads, saves=plan.saves)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if KVConnectorWorkerMetadata is not None and isinstance(meta, KvqWorkerMetadata):
            self._scheduler.worker_reports(meta.saved, meta.failed, meta.released)

    def take_events(self):
        """KV events (medium "kvq") with vLLM's own block hashes: BlockStored
        once every rank's worker reported the save committed, BlockRemoved
        where kvq was seen not to serve announced blocks any more
        (vllm_events.py; docs/VLLM.md, "KV events")."""
        if not self._events:
            return []
        out = []
        for e in self._scheduler.take_events():
            if isinstance(e, Stored):
                lora_id, lora_name_ = e.extra or (None, None)
                out.append(BlockStored(
                    block_hashes=[maybe_convert_block_hash(h) for h in e.block_hashes],
                    parent_block_hash=None if e.parent_block_hash is None else
                    maybe_convert_block_hash(e.parent_block_hash),
                    token_ids=e.token_ids, block_size=self._block_size, lora_id=lora_id,
                    medium="kvq", lora_name=lora_name_))
            elif isinstance(e, Removed):
                out.append(BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(h) for h in e.block_hashes],
                    medium="kvq"))
        return out

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._scheduler.finished(request.request_id)
        # Saves were copied to the host in their step: vLLM may free the blocks.
        return False, None

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset() if self._scheduler else None

    # --------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker.start_load(self._get_connector_metadata().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        self._worker.save_layer(layer_name, kv_layer, self._get_connector_metadata().saves)

    def wait_for_save(self):
        self._worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                               set[str] | None]:
        self._worker.get_finished(finished_req_ids)
        return None, None

    def build_connector_worker_meta(self) -> "KVConnectorWorkerMetadata | None":
        # The send thread's reports of commits and releases, for the
        # scheduler side's KV events (dropped when vLLM publishes none).
        reports = self._worker.take_reports()
        if reports is None or not self._events:
            return None
        return KvqWorkerMetadata(*reports)

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ------------------------------------------------------------ metrics

    def get_kv_connector_stats(self) -> "KVConnectorStats | None":
        if KVConnectorStats is None:
            return None
        data = self._counters.take()
        return None if is_empty(data) else KvqConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> "KVConnectorStats | None":
        if KVConnectorStats is None:
            return None
        return KvqConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict,
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> "KVConnectorPromMetrics | None":
        if KVConnectorPromMetrics is None:
            return None
        return KvqPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


if KVConnectorStats is not None:

    @dataclass
    class KvqConnectorStats(KVConnectorStats):
        """The connector's counters (vllm_stats.py) as vLLM carries them from
        the workers and the scheduler to its logger."""

        def reset(self):
            self.data = {}

        def aggregate(self, other: "KVConnectorStats") -> "KVConnectorStats":
            self.data = merge(self.data, other.data)
            return self

        def reduce(self) -> Dict[str, int | float]:
            return reduce(self.data)

        def is_empty(self) -> bool:
            return is_empty(self.data)

    class KvqPromMetrics(KVConnectorPromMetrics):
        """vllm:kvq_* in vLLM's /metrics: a counter per count, a histogram
        per latency, the breaker state as a gauge (0 closed, 1 open, 2 half
        open), each with vLLM's engine labels."""

        _HELP = {
            "lookup_hits": "Lookups that found tokens in kvq.",
            "lookup_misses": "Lookups that found no tokens in kvq.",
            "lookup_skipped": "Lookups answered 0 because kvq's circuit breaker was open.",
            "hit_tokens": "Tokens kvq offered on lookup hits.",
            "tokens_loaded": "Tokens loaded from kvq into vLLM's KV cache.",
            "tokens_saved": "Tokens committed to kvq.",
            "bytes_loaded": "Payload bytes received from kvq.",
            "bytes_saved": "Payload bytes sent to kvq.",
            "load_failures": "kvq loads that failed (their blocks recomputed).",
            "save_failures": "kvq saves that failed or were dropped.",
            "rpc_failures": "kvq calls that failed with a service error.",
            "breaker_opened": "Times kvq's circuit breaker opened.",
        }

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters = {
                name: self._counter_cls(name=f"vllm:kvq_{name}_total",
                                        documentation=self._HELP[name], labelnames=labelnames)
                for name in COUNTS}
            self._histograms = {
                name: self._histogram_cls(
                    name=f"vllm:kvq_{name}", documentation=f"kvq {name[:-8]} latency.",
                    buckets=[1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
                    labelnames=labelnames)
                for name in SAMPLES}
            self._breaker = self._gauge_cls(
                name="vllm:kvq_breaker_state",
                documentation="kvq circuit breaker: 0 closed, 1 open (kvq skipped), 2 half open.",
                labelnames=labelnames, multiprocess_mode="mostrecent")

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
            labels = self.per_engine_labelvalues[engine_idx]
            for name in COUNTS:
                n = transfer_stats_data.get(name, 0)
                if n:
                    self._counters[name].labels(*labels).inc(n)
            for name in SAMPLES:
                for x in transfer_stats_data.get(name, []):
                    self._histograms[name].labels(*labels).observe(x)
            self._breaker.labels(*labels).set(transfer_stats_data.get("breaker_state", 0))
