"""The worker half of the vLLM connector (vllm_connector.py), with torch but
without vLLM, so that CI without vLLM drives it against a real server.

Loads are asynchronous and layer-wise: start_load() hands the step's loads
to a fetch thread, which fetches a group of layers at a time (at most
kvq_load_buffer_bytes in flight, host buffers pinned when CUDA is there)
while the forward pass runs; wait_for_layer() waits for that layer's host
copy and writes it into the paged cache on the caller's (compute) stream, so
the attention of the layer sees it and later writes to those blocks come
after it. A failed fetch reports the range's blocks to vLLM, which
recomputes them.

Saves do not wait for kvq: save_layer() gathers the layer's new tokens and
copies them to the host on the compute stream (later writes to the blocks
are ordered after the copy, so vLLM may reuse the blocks at once); a send
thread streams them into one Append per sequence and step and commits it
when wait_for_save() has closed the step. Steps are sent in order, so a
sequence's next Append starts from its last commit. The thread releases a
finished request's sequences after its last commit.

The send thread reports what kvq acknowledged (take_reports): each save
committed or failed, each request's sequences released; vLLM carries the
reports to the scheduler side, whose KV events announce only what every
rank committed (vllm_events.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from .circuit_breaker import CircuitBreaker
from .client import KvqError, ModelLayout
from .layer_append import LayerAppend
from .vllm_paged import check_layer_view, gather, scatter, slot_indices
from .vllm_plan import TokenRange
from .vllm_events import save_key
from .vllm_settings import Clients, KvqSettings, rank_namespace
from .vllm_stats import ConnectorCounters, note_outcome

logger = logging.getLogger("kvq_client.vllm_connector")

# torch dtype of the paged cache -> kvq's wire dtype.
WIRE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_STOP = object()


def layer_order(names: List[str]) -> List[str]:
    """Attention layer names in model order: by the layer number in the name
    ("model.layers.3.self_attn.attn"), else as given."""
    import re
    numbers = [re.findall(r"\d+", n) for n in names]
    if all(len(x) == 1 for x in numbers) and len({x[0] for x in numbers}) == len(names):
        return sorted(names, key=lambda n: int(re.findall(r"\d+", n)[0]))
    return list(names)


def rank_sequence(r: TokenRange, rank: int) -> str:
    """This rank's sequence of a range (the scheduler lists one per rank)."""
    ids = r.sequence_id.split(",")
    if rank >= len(ids):
        raise ValueError(f"range of {r.request_id} lists {len(ids)} sequences, rank {rank}")
    return ids[rank]


class WorkerReports:
    """What the send thread learned since the last take: saves committed or
    failed (vllm_events.save_key -> 1) and requests whose sequences this
    worker released (-> 1). Counts, so that vLLM's aggregation over
    tensor-parallel workers adds them up."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._lock = threading.Lock()
        self.saved: Dict[str, int] = {}
        self.failed: Dict[str, int] = {}
        self.released: Dict[str, int] = {}

    def add(self, kind: str, key: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            d = getattr(self, kind)
            d[key] = d.get(key, 0) + 1

    def take(self) -> Optional[Tuple[Dict[str, int], Dict[str, int], Dict[str, int]]]:
        with self._lock:
            if not (self.saved or self.failed or self.released):
                return None
            out = (self.saved, self.failed, self.released)
            self.saved, self.failed, self.released = {}, {}, {}
            return out


class _Load:
    """One step's loads: the fetch thread fills `host[layer]`, the compute
    thread consumes it."""

    def __init__(self, ranges: List[TokenRange], num_layers: int):
        self.ranges = ranges
        self.cond = threading.Condition()
        self.host: Dict[int, List[Optional[Tuple[torch.Tensor, torch.Tensor]]]] = {}
        self.failed: Set[int] = set()   # Indexes into ranges.
        self.fetched = 0                # Layers [0, fetched) are in host (or failed).
        self.consumed: Set[int] = set()
        self.in_flight_bytes = 0
        self.layer_bytes = 0
        self.num_layers = num_layers


class KvqWorker:

    def __init__(self, settings: KvqSettings, layout: ModelLayout, block_size: int,
                 rank: int = 0, world_size: int = 1, clients: Optional[Clients] = None,
                 breaker: Optional[CircuitBreaker] = None,
                 counters: Optional[ConnectorCounters] = None, reports: bool = True):
        self._settings = settings
        self._layout = layout
        self._block_size = block_size
        self._rank = rank
        self._world_size = world_size
        self._clients = clients or Clients(settings)
        self.breaker = breaker or settings.breaker()
        self.counters = counters or ConnectorCounters()
        self._caches: Dict[str, torch.Tensor] = {}
        self._names: List[str] = []
        self._layer_index: Dict[str, int] = {}
        self._pin = torch.cuda.is_available()
        self._load: Optional[_Load] = None
        self._load_errors: Set[int] = set()
        self._errors_lock = threading.Lock()
        self._sequences: Dict[str, Tuple[str, str]] = {}  # request -> (namespace, sequence)
        # Send thread: a FIFO of ("layer", step, ...), ("commit", step),
        # ("release", ...) items.
        self._send_queue: "queue.Queue" = queue.Queue()
        self._committed: Dict[str, int] = {}   # sequence -> tokens committed (-1: broken)
        self._step = 0
        self._step_saves: Dict[str, TokenRange] = {}
        self.reports = WorkerReports(reports)
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._sender = threading.Thread(target=self._send_loop, name="kvq-send", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------ set-up

    def register_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        names = layer_order(list(kv_caches))
        if len(names) != self._layout.num_layers:
            raise ValueError(f"{len(names)} KV cache layers registered, the model has "
                             f"{self._layout.num_layers}")
        for name in names:
            cache = kv_caches[name]
            check_layer_view(cache, self._layout.num_kv_heads, self._layout.head_dim)
            if cache.dtype not in WIRE:
                raise ValueError(f"KV cache dtype {cache.dtype} of {name}: kvq takes "
                                 "float16, bfloat16 or float32 caches")
        self._caches = {n: kv_caches[n] for n in names}
        self._names = names
        self._layer_index = {n: i for i, n in enumerate(names)}

    def _client(self, r: TokenRange):
        namespace = rank_namespace(r.namespace, self._rank, self._world_size)
        return self._clients.get(namespace), rank_sequence(r, self._rank)

    def _note(self, error: Optional[BaseException]) -> None:
        if note_outcome(self.breaker, self.counters, error):
            logger.warning("kvq: %d failures in a row; skipping kvq for a back-off",
                           self._settings.breaker_failures)

    def _remember(self, r: TokenRange) -> None:
        self._sequences[r.request_id] = (r.namespace, r.sequence_id)

    # -------------------------------------------------------------- loads

    def start_load(self, loads: Sequence[TokenRange]) -> None:
        """Starts the step's loads in the background (wait_for_layer, then
        finish_load, complete them)."""
        self.finish_load()  # A step whose layers were never waited for.
        if not loads:
            return
        for r in loads:
            self._remember(r)
        if not self.breaker.allow():
            self.counters.breaker_state = int(self.breaker.state)
            for r in loads:
                self._fail_range(r, "kvq skipped (circuit breaker open)")
            return
        load = self._load = _Load(list(loads), len(self._names))
        threading.Thread(target=self._fetch_loop, args=(load,), name="kvq-fetch",
                         daemon=True).start()

    def _fail_range(self, r: TokenRange, why) -> None:
        first, last = r.begin // self._block_size, (r.end - 1) // self._block_size
        with self._errors_lock:
            self._load_errors.update(r.block_ids[first:last + 1])
        self.counters.add("load_failures")
        logger.warning("kvq: load of %s tokens [%d, %d) failed (%s); vLLM recomputes them",
                       r.request_id, r.begin, r.end, why)

    def _host(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self._pin)

    def _fetch_loop(self, load: _Load) -> None:
        try:
            self._fetch_layers(load)
        except Exception as e:  # noqa: BLE001  The compute side must not wait forever.
            logger.exception("kvq: fetch thread")
            with load.cond:
                for ri, r in enumerate(load.ranges):
                    if ri not in load.failed:
                        load.failed.add(ri)
                        self._fail_range(r, e)
                for layer in range(load.fetched, len(self._names)):
                    load.host[layer] = [None] * len(load.ranges)
                load.fetched = len(self._names)
                load.cond.notify_all()

    def _fetch_layers(self, load: _Load) -> None:
        wire = WIRE[self._caches[self._names[0]].dtype]
        host_dtype = torch.float16 if wire == "fp16" else torch.float32  # bf16 decodes to fp32.
        item = 2 if wire == "fp16" else 4
        h, d = self._layout.num_kv_heads, self._layout.head_dim
        tokens = sum(r.end - r.begin for r in load.ranges)
        layer_bytes = max(1, 2 * h * tokens * d * item)
        group = max(1, min(len(self._names), self._settings.load_buffer_bytes // layer_bytes))
        load.layer_bytes = layer_bytes
        started = time.monotonic()
        for begin in range(0, len(self._names), group):
            n = min(group, len(self._names) - begin)
            with load.cond:  # Bounded host memory: wait for the compute side.
                load.cond.wait_for(lambda: load.in_flight_bytes == 0 or
                                   load.in_flight_bytes + n * layer_bytes <=
                                   self._settings.load_buffer_bytes)
            per_layer: Dict[int, List] = {begin + i: [] for i in range(n)}
            for ri, r in enumerate(load.ranges):
                if ri in load.failed:
                    for i in range(n):
                        per_layer[begin + i].append(None)
                    continue
                shape = (n, h, r.end - r.begin, d)
                K, V = self._host(shape, host_dtype), self._host(shape, host_dtype)
                try:
                    client, sid = self._client(r)
                    if not sid:  # The scheduler could not create it.
                        raise ValueError("its kvq sequence was not created")
                    client.fetch(sid, layer_begin=begin, token_begin=r.begin, dtype=wire,
                                 max_chunk_bytes=self._settings.max_chunk_bytes,
                                 out=(K.numpy(), V.numpy()))
                    self._note(None)
                    self.counters.add("bytes_loaded", 2 * K.numel() * item)
                    for i in range(n):
                        per_layer[begin + i].append((K[i], V[i]))
                except (KvqError, ValueError) as e:
                    if isinstance(e, KvqError):  # A ValueError says nothing of kvq.
                        self._note(e)
                    with load.cond:
                        load.failed.add(ri)
                    self._fail_range(r, e)
                    for i in range(n):
                        per_layer[begin + i].append(None)
            with load.cond:
                load.host.update(per_layer)
                load.in_flight_bytes += n * layer_bytes
                load.fetched = begin + n
                load.cond.notify_all()
        self.counters.observe("load_seconds", time.monotonic() - started)

    def wait_for_layer(self, layer_name: str) -> None:
        """Blocks until the layer's loads are in the paged cache (written on
        the caller's stream). Layers before it are completed first: the
        fetch thread works in model order within a bounded buffer."""
        load = self._load
        layer = self._layer_index.get(layer_name)
        if load is None or layer is None:
            return
        for earlier in range(layer + 1):
            if earlier not in load.consumed:
                self._consume(load, earlier)

    def _consume(self, load: _Load, layer: int) -> None:
        layer_name = self._names[layer]
        with load.cond:
            load.cond.wait_for(lambda: load.fetched > layer)
            parts = load.host.pop(layer)
            failed = set(load.failed)
        cache = self._caches[layer_name]
        for ri, (r, part) in enumerate(zip(load.ranges, parts)):
            if part is None or ri in failed:
                continue
            block, offset = slot_indices(r.block_ids, self._block_size, cache.shape[2],
                                         r.begin, r.end)
            k, v = part
            scatter(cache, block, offset, k.to(cache.device, non_blocking=True),
                    v.to(cache.device, non_blocking=True))
        # No sync: torch's pinned-memory allocator keeps a buffer until the
        # copies that read it are done.
        with load.cond:
            load.consumed.add(layer)
            load.in_flight_bytes -= load.layer_bytes
            load.cond.notify_all()

    def finish_load(self) -> None:
        """Completes the step's loads: layers vLLM did not wait for, and the
        token counts."""
        load, self._load = self._load, None
        if load is None:
            return
        for layer in range(len(self._names)):
            if layer not in load.consumed:
                self._consume(load, layer)
        for ri, r in enumerate(load.ranges):
            if ri not in load.failed:
                self.counters.add("tokens_loaded", r.end - r.begin)

    def take_load_errors(self) -> Set[int]:
        self.finish_load()
        with self._errors_lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # -------------------------------------------------------------- saves

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor,
                   saves: Sequence[TokenRange]) -> None:
        """Copies the layer's new tokens of every save to the host and queues
        them for the send thread."""
        layer = self._layer_index.get(layer_name)
        if layer is None or not saves:
            return
        for r in saves:
            self._remember(r)
            self._step_saves[r.sequence_id] = r
            block, offset = slot_indices(r.block_ids, self._block_size, kv_layer.shape[2],
                                         r.begin, r.end)
            k, v = gather(kv_layer, block, offset)
            hk = self._host(k.shape, k.dtype)
            hv = self._host(v.shape, v.dtype)
            hk.copy_(k, non_blocking=self._pin)
            hv.copy_(v, non_blocking=self._pin)
            event = None
            if self._pin and kv_layer.is_cuda:
                event = torch.cuda.Event()
                event.record()
            self._enqueue(("layer", self._step, r, layer, hk, hv, event))

    def wait_for_save(self) -> None:
        """Closes the step: its Appends commit in the background."""
        self.finish_load()
        if self._step_saves:
            self._enqueue(("commit", self._step, dict(self._step_saves)))
            self._step_saves = {}
        self._step += 1

    def _enqueue(self, item) -> None:
        with self._pending_lock:
            self._pending += 1
            self._idle.clear()
        self._send_queue.put(item)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Waits until everything queued was sent and committed (tests,
        shutdown)."""
        return self._idle.wait(timeout)

    def _send_loop(self) -> None:
        streams: Dict[str, Tuple[LayerAppend, Set[int], float]] = {}
        while True:
            item = self._send_queue.get()
            if item is _STOP:
                return
            try:
                self._send(item, streams)
            except Exception:  # noqa: BLE001  The thread must survive any one item.
                logger.exception("kvq: send thread")
            with self._pending_lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.set()

    def _send(self, item, streams) -> None:
        kind = item[0]
        if kind == "layer":
            _, _, r, layer, hk, hv, event = item
            sid = rank_sequence(r, self._rank)
            entry = streams.get(sid)
            if entry is None:
                committed = self._committed.get(sid)
                if not sid or (committed is not None and committed != r.begin) or \
                        not self.breaker.allow():
                    # Not created, an earlier save failed (appending would
                    # misplace) or kvq is being skipped.
                    streams[sid] = entry = (None, set(), 0.0)
                    self._committed[sid] = -1
                else:
                    client, _ = self._client(r)
                    owner = client.client_for(sid)
                    # Raw pages quantized here where the scheme has them
                    # (and kvq's native module is installed).
                    scheme = self._settings.scheme if self._settings.quantize_on_client \
                        else None
                    stream = LayerAppend(owner, sid, self._settings.max_chunk_bytes,
                                         token_ids=r.token_ids,
                                         deadline=self._settings.save_deadline_seconds,
                                         scheme=scheme, start_tokens=r.begin,
                                         head_dim=self._layout.head_dim)
                    streams[sid] = entry = (stream, set(), time.monotonic())
            stream = entry[0]
            if stream is None:
                return
            if event is not None:
                event.synchronize()
            # Raw pages quantized here where the scheme has them; dense
            # tokens in the cache's dtype (bf16 as bf16 bits).
            stream.add_layer(layer, hk, hv)
            entry[1].add(layer)
        elif kind == "commit":
            _, _, saves = item
            for sid_all, r in saves.items():
                sid = rank_sequence(r, self._rank)
                stream, layers, started = streams.pop(sid, (None, set(), 0.0))
                key = save_key(r.request_id, r.end)
                if stream is None:
                    self.counters.add("save_failures")
                    self.reports.add("failed", key)
                    continue
                if len(layers) != self._layout.num_layers:
                    stream.cancel()
                    self._committed[sid] = -1
                    self.counters.add("save_failures")
                    self.reports.add("failed", key)
                    logger.warning("kvq: save of %s got %d of %d layers; dropped",
                                   r.request_id, len(layers), self._layout.num_layers)
                    continue
                try:
                    num_tokens = stream.finish()
                    self._note(None)
                except KvqError as e:
                    self._note(e)
                    self._committed[sid] = -1
                    self.counters.add("save_failures")
                    self.reports.add("failed", key)
                    logger.warning("kvq: save of %s tokens [%d, %d) failed: %s", r.request_id,
                                   r.begin, r.end, e)
                    continue
                self._committed[sid] = num_tokens if num_tokens == r.end else -1
                # Committed but not where planned: kvq holds other tokens there.
                self.reports.add("saved" if num_tokens == r.end else "failed", key)
                self.counters.add("tokens_saved", r.end - r.begin)
                self.counters.add("bytes_saved", stream.wire_bytes)
                self.counters.observe("save_seconds", time.monotonic() - started)
        elif kind == "release":
            _, request_id, namespace, sequence_ids = item
            self._release(namespace, sequence_ids)
            self.reports.add("released", request_id)

    def _release(self, namespace: str, sequence_ids: str) -> None:
        """Releases this rank's sequence of a finished request."""
        for i, sid in enumerate(sequence_ids.split(",")):
            if i != self._rank:
                continue
            self._committed.pop(sid, None)
            if not sid or not self._settings.release_on_finish or not self.breaker.allow():
                continue
            try:
                ns = rank_namespace(namespace, self._rank, self._world_size)
                self._clients.get(ns).release(
                    sid, deadline=self._settings.scheduler_deadline_seconds)
                self._note(None)
            except KvqError as e:  # Its lease expires it anyway.
                self._note(e)
                logger.warning("kvq: release of %s failed: %s", sid, e)

    # ----------------------------------------------------------- finish

    def get_finished(self, finished_req_ids: Set[str]) -> None:
        """Releases finished requests' sequences after their last commit (the
        send thread's FIFO puts the release behind it)."""
        for rid in finished_req_ids:
            known = self._sequences.pop(rid, None)
            if known is not None:
                self._enqueue(("release", rid, known[0], known[1]))

    def take_reports(self):
        """(saved, failed, released) since the last call, or None (see
        WorkerReports)."""
        return self.reports.take()

    def shutdown(self, timeout: float = 10.0) -> None:
        self.finish_load()
        self.drain(timeout)
        self._send_queue.put(_STOP)
        self._sender.join(timeout)
        self._clients.close()
