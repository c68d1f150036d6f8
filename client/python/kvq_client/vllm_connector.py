"""KvqConnector: kvq as a vLLM V1 KV-transfer connector (see docs/VLLM.md).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvqConnector",
        "kv_connector_module_path": "kvq_client.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvq_address": "127.0.0.1:50051"}}'

Scheduler side: the first lookup of a request creates its kvq sequence with
the prompt's token ids; kvq starts it with the longest prefix of whole
blocks already stored under the same namespace, layout and scheme (a chained
hash of the token pages, as vLLM's own block hashes), and that prefix is the
external hit vLLM is told about. StepPlanner (vllm_plan.py) turns the
scheduler's decisions into per-step load and save ranges.

Worker side: start_load_kv fetches each loaded range (FetchDequant, all
layers) and writes it into vLLM's paged cache before the forward pass;
save_kv_layer sends each layer's new prompt tokens into one Append stream
per request while later layers compute (LayerAppend), and wait_for_save
commits the streams. The tokens the server would quantize are quantized
here (kvq's native kernels) and go as raw pages; the rest goes dense.

This module imports vLLM and torch; the rest of kvq_client does not.
"""

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Set, Tuple

import grpc
import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                KVConnectorMetadata,
                                                                KVConnectorRole)

from .client import KvqClient, KvqError, ModelLayout
from .layer_append import LayerAppend
from .vllm_paged import check_layer_view, gather, scatter, slot_indices
from .vllm_plan import StepPlan, StepPlanner, TokenRange

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

DEFAULT_SCHEME = "kivi4:g32:r128:sink=4"

# torch dtype of the paged cache -> the wire dtype kvq receives and returns.
_WIRE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass
class KvqConnectorMetadata(KVConnectorMetadata):
    loads: List[TokenRange] = field(default_factory=list)
    saves: List[TokenRange] = field(default_factory=list)


@dataclass
class KvqSettings:
    """kv_connector_extra_config keys (all optional)."""
    address: str = "localhost:50051"   # kvq_address
    namespace: str = ""                # kvq_namespace; "" -> "vllm/<model>"
    scheme: str = DEFAULT_SCHEME       # kvq_scheme
    ttl_seconds: int = 0               # kvq_ttl_seconds; 0: the server's default
    deadline_seconds: float = 30.0     # kvq_deadline_seconds, per worker call
    # kvq_scheduler_deadline_seconds: per scheduler-side call (create, stats,
    # release), which vLLM's scheduler loop waits for.
    scheduler_deadline_seconds: float = 5.0
    max_chunk_bytes: int = 1 << 20     # kvq_max_chunk_bytes, per Append / fetch message
    load_buffer_bytes: int = 64 << 20  # kvq_load_buffer_bytes: host buffer of a load
    release_on_finish: bool = True     # kvq_release_on_finish

    @classmethod
    def from_extra_config(cls, extra: Dict[str, Any], model: str) -> "KvqSettings":
        known = {f"kvq_{name}" for name in cls.__dataclass_fields__}
        unknown = sorted(k for k in extra if k.startswith("kvq_") and k not in known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown keys {unknown}; "
                             f"known: {sorted(known)}")
        s = cls(**{k[4:]: extra[k] for k in extra if k in known})
        if not s.namespace:
            s.namespace = f"vllm/{model}"
        if "pre_rope" in s.scheme.split(":"):
            raise ValueError(f"kvq_scheme {s.scheme!r}: vLLM's cache holds keys after "
                             "RoPE, so pre_rope schemes cannot be used")
        return s


def model_layout(vllm_config: "VllmConfig") -> ModelLayout:
    """kvq's layout of the model vLLM serves (one tensor- and pipeline-parallel rank)."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ValueError("KvqConnector supports tensor_parallel_size 1 and "
                         f"pipeline_parallel_size 1, got {parallel.tensor_parallel_size} "
                         f"and {parallel.pipeline_parallel_size}")
    m = vllm_config.model_config
    return ModelLayout(m.get_num_layers(parallel), m.get_num_kv_heads(parallel),
                       m.get_num_attention_heads(parallel), m.get_head_size())


def keyed_by_tokens_alone(request: "Request") -> bool:
    """Whether the prompt's token ids determine its KV. kvq keys a prefix by
    token ids only: images (placeholder tokens), a LoRA adapter or a cache
    salt (vLLM's per-tenant prefix-cache isolation) make the same ids mean
    other KV, so such requests bypass the connector."""
    return (not getattr(request, "mm_features", None)
            and getattr(request, "lora_request", None) is None
            and not getattr(request, "cache_salt", None))


def layer_order(names: List[str]) -> List[str]:
    """Attention layer names in model order: by the layer number in the name
    ("model.layers.3.self_attn.attn"), else as given."""
    numbers = [re.findall(r"\d+", n) for n in names]
    if all(len(x) == 1 for x in numbers) and len({x[0] for x in numbers}) == len(names):
        return sorted(names, key=lambda n: int(re.findall(r"\d+", n)[0]))
    return list(names)


class KvqConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self._settings = KvqSettings.from_extra_config(
            dict(transfer.kv_connector_extra_config or {}), vllm_config.model_config.model)
        self._layout = model_layout(vllm_config)
        self._block_size = vllm_config.cache_config.block_size
        self._id_prefix = f"vllm-{transfer.engine_id}-"
        self._scheduler_deadline = self._settings.scheduler_deadline_seconds
        self._client = KvqClient(self._settings.address, namespace=self._settings.namespace,
                                 deadline=self._settings.deadline_seconds)
        # Scheduler side.
        self._planner = StepPlanner(save=transfer.is_kv_producer, load=transfer.is_kv_consumer)
        # Worker side.
        self._caches: Dict[str, torch.Tensor] = {}
        self._layer_index: Dict[str, int] = {}
        self._appends: Dict[str, Tuple[TokenRange, LayerAppend, Set[int]]] = {}
        self._saved: Dict[str, int] = {}       # Sequence -> tokens committed (-1: broken).
        self._load_errors: Set[int] = set()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # save_kv_layer runs in every attention layer: a full CUDA graph
        # replay would skip it and lose the saves.
        return True

    # ------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if not self._planner.known(rid):
            prompt = request.prompt_token_ids
            if not prompt or not keyed_by_tokens_alone(request):
                return 0, False
            try:
                info = self._create_sequence(self._id_prefix + rid, list(prompt))
            except KvqError as e:
                logger.warning("kvq: no sequence for request %s (%s); it runs without "
                               "the cache", rid, e)
                return 0, False
            self._planner.add_request(rid, info[0], len(prompt), info[1])
        elif self._planner.saved_past_match(rid):
            # Looked up again (preempted and back in the queue): what this
            # request saved itself can be loaded instead of recomputed.
            try:
                stats = self._client.stats(self._planner.sequence_id(rid),
                                           deadline=self._scheduler_deadline)
                self._planner.refresh(rid, stats.num_tokens)
            except KvqError as e:
                logger.warning("kvq: stats of request %s failed: %s", rid, e)
        return self._planner.matched_tokens(rid, request.num_tokens, num_computed_tokens), False

    def _create_sequence(self, sequence_id: str, prompt: List[int]) -> Tuple[str, int]:
        try:
            info = self._client.create_sequence(self._layout, scheme=self._settings.scheme,
                                                sequence_id=sequence_id,
                                                ttl_seconds=self._settings.ttl_seconds,
                                                prompt_token_ids=prompt,
                                                deadline=self._scheduler_deadline)
            return info.sequence_id, info.num_tokens
        except KvqError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
            # An earlier create whose reply was lost: take the sequence as it is.
            return sequence_id, self._client.stats(sequence_id,
                                                   deadline=self._scheduler_deadline).num_tokens

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        self._planner.after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        plan = StepPlan()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._planner.scheduled(plan, new.req_id, new.block_ids[0], True,
                                    new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            self._planner.scheduled(plan, rid, blocks[0] if blocks else None,
                                    rid in cached.resumed_req_ids,
                                    cached.num_computed_tokens[i], scheduled.get(rid, 0))
        return KvqConnectorMetadata(loads=plan.loads, saves=plan.saves)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        sequence_id = self._planner.finish(request.request_id)
        if sequence_id is not None and self._settings.release_on_finish:
            try:
                self._client.release(sequence_id, deadline=self._scheduler_deadline)
            except KvqError as e:  # Its lease expires it anyway.
                logger.warning("kvq: release of %s failed: %s", sequence_id, e)
        return False, None  # Saves finish within their step: vLLM may free the blocks.

    # --------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = layer_order(list(kv_caches))
        if len(names) != self._layout.num_layers:
            raise ValueError(f"{len(names)} KV cache layers registered, the model has "
                             f"{self._layout.num_layers}")
        for name in names:
            cache = kv_caches[name]
            check_layer_view(cache, self._layout.num_kv_heads, self._layout.head_dim)
            if cache.dtype not in _WIRE:
                raise ValueError(f"KV cache dtype {cache.dtype} of {name}: kvq takes "
                                 "float16, bfloat16 or float32 caches")
        self._caches = {n: kv_caches[n] for n in names}
        self._layer_index = {n: i for i, n in enumerate(names)}

    def _slots(self, r: TokenRange, cache: torch.Tensor):
        return slot_indices(r.block_ids, self._block_size, cache.shape[2], r.begin, r.end)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for r in meta.loads:
            try:
                self._load(r)
            except (KvqError, ValueError) as e:
                # vLLM recomputes the tokens of the blocks reported here.
                first, last = r.begin // self._block_size, (r.end - 1) // self._block_size
                self._load_errors.update(r.block_ids[first:last + 1])
                logger.warning("kvq: load of %s tokens [%d, %d) failed: %s", r.sequence_id,
                               r.begin, r.end, e)

    def _load(self, r: TokenRange) -> None:
        """Fetches the range a group of layers at a time into one reused host
        buffer of at most kvq_load_buffer_bytes (one layer if a layer is
        larger) and writes each layer into its paged cache."""
        names = list(self._caches)
        first = self._caches[names[0]]
        wire = _WIRE[first.dtype]
        host = np.float16 if wire == "fp16" else np.float32  # bf16 arrives as float32.
        tokens = r.end - r.begin
        layer_bytes = 2 * self._layout.num_kv_heads * tokens * self._layout.head_dim * \
            np.dtype(host).itemsize
        group = max(1, min(len(names), self._settings.load_buffer_bytes // max(layer_bytes, 1)))
        shape = (group, self._layout.num_kv_heads, tokens, self._layout.head_dim)
        K, V = np.empty(shape, host), np.empty(shape, host)
        block, offset = self._slots(r, first)
        for begin in range(0, len(names), group):
            n = min(group, len(names) - begin)
            self._client.fetch(r.sequence_id, layer_begin=begin, token_begin=r.begin,
                               dtype=wire, max_chunk_bytes=self._settings.max_chunk_bytes,
                               out=(K[:n], V[:n]))
            for i in range(n):
                scatter(self._caches[names[begin + i]], block, offset, torch.from_numpy(K[i]),
                        torch.from_numpy(V[i]))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loads every layer before the forward pass.

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for r in self._get_connector_metadata().saves:
            committed = self._saved.get(r.sequence_id)
            if committed is not None and committed != r.begin:
                continue  # An earlier save of this sequence failed: appending would misplace.
            entry = self._appends.get(r.sequence_id)
            if entry is None:
                wire = _WIRE[kv_layer.dtype]
                # Quantized here where the scheme has raw pages: only
                # stored bytes travel.
                stream = LayerAppend(self._client, r.sequence_id,
                                     max_chunk_bytes=self._settings.max_chunk_bytes, wire=wire,
                                     scheme=self._settings.scheme, start_tokens=r.begin,
                                     head_dim=self._layout.head_dim)
                entry = self._appends[r.sequence_id] = (r, stream, set())
            block, offset = self._slots(r, kv_layer)
            k, v = gather(kv_layer, block, offset)
            if kv_layer.dtype == torch.bfloat16:  # numpy has no bfloat16; bf16 on the wire.
                k, v = k.float(), v.float()
            entry[1].add_layer(layer, k.cpu().numpy(), v.cpu().numpy())
            entry[2].add(layer)

    def wait_for_save(self):
        appends, self._appends = self._appends, {}
        for sequence_id, (r, stream, layers) in appends.items():
            if len(layers) != self._layout.num_layers:
                stream.cancel()
                self._saved[sequence_id] = -1
                logger.warning("kvq: save of %s got %d of %d layers; dropped", sequence_id,
                               len(layers), self._layout.num_layers)
                continue
            try:
                num_tokens = stream.finish()
            except KvqError as e:
                self._saved[sequence_id] = -1
                logger.warning("kvq: save of %s tokens [%d, %d) failed: %s", sequence_id,
                               r.begin, r.end, e)
                continue
            self._saved[sequence_id] = num_tokens if num_tokens == r.end else -1

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                               set[str] | None]:
        for rid in finished_req_ids:
            self._saved.pop(self._id_prefix + rid, None)
        return None, None

    def shutdown(self):
        for _, stream, _ in self._appends.values():
            stream.cancel()
        self._appends = {}
        self._client.close()
