"""The scheduler half of the vLLM connector (vllm_connector.py), without vLLM
or torch, so that CI without vLLM drives it against a real server.

A lookup (vLLM's get_num_new_matched_tokens, which must have no side
effects) is a read-only MatchPrefix per tensor-parallel rank: it asks how
many leading prompt tokens kvq holds under the request's namespace, layout
and scheme, and creates, forks or pins nothing on the server. It runs on a
background thread with a short deadline (kvq_lookup_deadline_seconds), and
the lookup waits at most kvq_lookup_wait_seconds for the answer (a budget
all lookups of one scheduler step share); if it is not there yet the lookup
answers None and vLLM asks again next step. Later lookups answer from what
the probe learned, with no call to kvq.

The request's kvq sequences (one per rank, created with the prompt's token
ids, so kvq starts each with the longest stored prefix of whole blocks) are
created once vLLM allocated its blocks (update_state_after_alloc, where the
scheduler may change state), in the background; build_connector_meta waits
for them (each call bounded by kvq_scheduler_deadline_seconds). Where the
creation fails, the request's planned load fails on the workers (vLLM
recomputes those tokens) and nothing of it is saved. Sequences are released
when the request finishes (by the workers, after their last commit, when
they saw it; here otherwise).

While the circuit breaker is open, lookups answer 0 at once: requests run
without kvq and vLLM computes every token itself.

With a BlockLedger (vllm_events.py; vLLM's KV events on) the scheduler
feeds it what kvq answered (lookups, creations), the saves planned, the
workers' reports of commits and releases (worker_reports), and runs the
ledger's release probes in the background.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import grpc

from .circuit_breaker import CircuitBreaker
from .client import KvqError, ModelLayout
from .vllm_events import BlockLedger, Probe
from .vllm_plan import StepPlan, StepPlanner
from .vllm_settings import Clients, KvqSettings, rank_namespace, request_namespace
from .vllm_stats import ConnectorCounters, note_outcome

logger = logging.getLogger("kvq_client.vllm_connector")


class KvqScheduler:

    def __init__(self, settings: KvqSettings, layout: ModelLayout, save: bool, load: bool,
                 world_size: int = 1, clients: Optional[Clients] = None,
                 breaker: Optional[CircuitBreaker] = None,
                 counters: Optional[ConnectorCounters] = None,
                 ledger: Optional[BlockLedger] = None):
        self._settings = settings
        self._layout = layout
        self._world_size = world_size
        self._clients = clients or Clients(settings)
        self.breaker = breaker or settings.breaker()
        self.counters = counters or ConnectorCounters()
        self.planner = StepPlanner(save=save, load=load,
                                   save_decode_tokens=settings.save_decode_tokens)
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvq-lookup")
        # request -> its MatchPrefix, when it started, the ledger's tick then.
        self._pending: Dict[str, Tuple[Future, float, int]] = {}
        self._prompts: Dict[str, List[int]] = {}     # request -> prompt, until created
        self._creating: Dict[str, Tuple[Future, int]] = {}  # request -> CreateSequence, tick
        self._namespaces: Dict[str, str] = {}   # request -> its kvq namespace
        self._seen_by_workers: Set[str] = set()
        self._epoch = 0
        self._wait_left = settings.lookup_wait_seconds  # This step's lookup wait budget.
        self.ledger = ledger
        # The ledger's release and audit probes: one thread of their own, so
        # that an audit never queues ahead of a lookup.
        self._probe_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvq-probe")
        self._next_audit = time.monotonic() + settings.events_audit_seconds
        self._probes: List[Tuple[Probe, Future]] = []  # The ledger's, in flight.

    # ------------------------------------------------------------ lookup

    def namespace_of(self, cache_salt: Optional[str], lora_name: Optional[str]) -> str:
        base = self._settings.namespace
        if self._epoch:
            base += f":epoch-{self._epoch}"
        return request_namespace(base, cache_salt, lora_name)

    def lookup(self, request_id: str, prompt_token_ids: Sequence[int], num_tokens: int,
               num_computed: int, cache_salt: Optional[str] = None,
               lora_name: Optional[str] = None, keyed_by_tokens: bool = True,
               block_hashes: Optional[Sequence[Any]] = None,
               event_extra: Any = None) -> Optional[int]:
        """Tokens past `num_computed` kvq can supply; None: ask again later.
        `block_hashes` (vLLM's, live) and `event_extra` go to the ledger."""
        rid = request_id
        if self.planner.known(rid):
            self.refresh_after_preemption(rid)
            return self.planner.matched_tokens(rid, num_tokens, num_computed)
        pending = self._pending.get(rid)
        if pending is None:
            if not prompt_token_ids or not keyed_by_tokens:
                return 0
            if not self.breaker.allow():
                self.counters.add("lookup_skipped")
                self.counters.breaker_state = int(self.breaker.state)
                return 0
            namespace = self.namespace_of(cache_salt, lora_name)
            tick = self.ledger.tick() if self.ledger else 0
            future = self._pool.submit(self._match, namespace, list(prompt_token_ids))
            pending = self._pending[rid] = (future, time.monotonic(), tick)
            self._namespaces[rid] = namespace
        future, started, tick = pending
        if not future.done() and self._wait_left > 0:
            # All lookups of one scheduler step share one wait budget.
            t0 = time.monotonic()
            try:
                future.result(timeout=self._wait_left)
            except Exception:  # noqa: BLE001  Read below, once done.
                pass
            self._wait_left -= time.monotonic() - t0
        if not future.done():
            return None  # vLLM asks again next step.
        del self._pending[rid]
        self.counters.observe("lookup_seconds", time.monotonic() - started)
        error = future.exception()
        self._note(error)
        if error is not None:
            self._namespaces.pop(rid, None)
            self.counters.add("lookup_misses")
            logger.warning("kvq: lookup of request %s failed (%s); it runs without the cache",
                           rid, error)
            return 0
        stored, block_tokens = future.result()
        if self.ledger is not None and block_hashes is not None:
            self.ledger.learn_block_tokens(block_tokens)
            self.ledger.served(block_hashes, len(prompt_token_ids), stored, tick)
            self.ledger.track(rid, self._namespaces[rid], block_hashes, prompt_token_ids,
                              event_extra, held_tokens=stored)
        # Its sequences are created after allocation (update_state_after_alloc).
        self.planner.add_request(rid, "", len(prompt_token_ids), stored)
        self._prompts[rid] = list(prompt_token_ids)
        matched = self.planner.matched_tokens(rid, num_tokens, num_computed)
        self.counters.add("lookup_hits" if matched > 0 else "lookup_misses")
        self.counters.add("hit_tokens", matched)
        return matched

    def _match(self, namespace: str, prompt: List[int]) -> Tuple[int, int]:
        """Read-only: the prompt tokens every rank's kvq holds (MatchPrefix),
        and kvq's prefix block."""
        matched, block_tokens = None, 0
        for rank in range(self._world_size):
            ns = rank_namespace(namespace, rank, self._world_size)
            r = self._clients.get(ns).match_prefix(
                self._layout, scheme=self._settings.scheme, prompt_token_ids=prompt,
                deadline=self._settings.lookup_deadline_seconds)
            matched = r.matched_tokens if matched is None else min(matched, r.matched_tokens)
            block_tokens = r.block_tokens
        return int(matched or 0), int(block_tokens)

    def _create(self, namespace: str, prompt: List[int]) -> Tuple[str, int]:
        """Creates the request's sequence on every rank; (ids joined by ",",
        the tokens every rank's holds). On a failure the ones created are
        released and the error raised."""
        created: List[Tuple[str, str]] = []
        stored = None
        try:
            for rank in range(self._world_size):
                ns = rank_namespace(namespace, rank, self._world_size)
                info = self._clients.get(ns).create_sequence(
                    self._layout, scheme=self._settings.scheme,
                    ttl_seconds=self._settings.ttl_seconds, prompt_token_ids=prompt,
                    deadline=self._settings.scheduler_deadline_seconds)
                created.append((ns, info.sequence_id))
                stored = info.num_tokens if stored is None else min(stored, info.num_tokens)
        except KvqError:
            for ns, sid in created:
                self._release(ns, sid)
            raise
        return ",".join(sid for _, sid in created), int(stored or 0)

    def _release(self, namespace: str, sequence_id: str) -> None:
        try:
            self._clients.get(namespace).release(
                sequence_id, deadline=self._settings.scheduler_deadline_seconds)
        except KvqError as e:  # Its lease expires it anyway.
            logger.warning("kvq: release of %s failed: %s", sequence_id, e)

    def _note(self, error: Optional[BaseException]) -> None:
        if note_outcome(self.breaker, self.counters, error):
            logger.warning("kvq: %d failures in a row; skipping kvq for %.0f s",
                           self._settings.breaker_failures,
                           self._settings.breaker_backoff_seconds)

    # ------------------------------------------------------ step planning

    def after_alloc(self, request_id: str, all_token_ids: Sequence[int],
                    num_external_tokens: int) -> None:
        self.planner.track_tokens(request_id, all_token_ids)
        if self.ledger is not None:
            self.ledger.set_token_ids(request_id, all_token_ids)
        self.planner.after_alloc(request_id, num_external_tokens)
        prompt = self._prompts.get(request_id)
        if prompt is not None and request_id not in self._creating and \
                (self.planner.save or num_external_tokens > 0):
            # The first allocation of a looked-up request: create its
            # sequences now (state changes belong here, not in the lookup).
            del self._prompts[request_id]
            namespace = self._namespaces.get(request_id, self._settings.namespace)
            tick = self.ledger.tick() if self.ledger else 0
            self._creating[request_id] = (self._pool.submit(self._create, namespace, prompt),
                                          tick)

    def _await_creations(self) -> None:
        """Gives the planner the sequences created since the last step."""
        for rid, (future, tick) in list(self._creating.items()):
            del self._creating[rid]
            try:
                sequence_ids, stored = future.result(
                    timeout=self._settings.scheduler_deadline_seconds)
                error = None
            except KvqError as e:
                error = e
            except Exception as e:  # noqa: BLE001  A timeout: as a failed creation.
                error = e
            self._note(error if isinstance(error, KvqError) or error is None else
                       KvqError(grpc.StatusCode.DEADLINE_EXCEEDED, str(error)))
            if error is None:
                self.planner.set_sequence(rid, sequence_ids, stored)
                if self.ledger is not None:
                    self.ledger.served_request(rid, self.planner.prompt_len(rid), stored, tick)
            else:
                logger.warning("kvq: no sequence for request %s (%s); it runs without the "
                               "cache", rid, error)
                self.planner.set_sequence(rid, "", None)
                if self.ledger is not None:
                    self.ledger.forget(rid)  # Nothing of it is saved.
                if self._settings.release_on_finish:
                    namespace = self._namespaces.get(rid, self._settings.namespace)
                    future.add_done_callback(lambda f, ns=namespace: self._release_created(f, ns))

    def build(self, scheduler_output: Any) -> StepPlan:
        """The step's loads and saves from vLLM's SchedulerOutput (read by
        attribute: scheduled_new_reqs, scheduled_cached_reqs,
        num_scheduled_tokens)."""
        self._wait_left = self._settings.lookup_wait_seconds  # A new step begins.
        self._await_creations()
        plan = StepPlan()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self.planner.scheduled(plan, new.req_id, new.block_ids[0], True,
                                   new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM < 0.34 lists a resumed request here (its blocks all new);
        # 0.34 sends it again among the new requests.
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            self.planner.scheduled(plan, rid, blocks[0] if blocks else None, rid in resumed,
                                   cached.num_computed_tokens[i], scheduled.get(rid, 0))
        for r in plan.loads + plan.saves:
            r.namespace = self._namespaces.get(r.request_id, self._settings.namespace)
            self._seen_by_workers.add(r.request_id)
        if self.ledger is not None:
            for r in plan.saves:
                self.ledger.planned(r.request_id, r.end)
        return plan

    def refresh_after_preemption(self, request_id: str) -> None:
        """A preempted request is looked up again: kvq may hold more of it
        (its own saves). Asks in the background; the next lookup uses it."""
        if not self.planner.saved_past_match(request_id) or not self.breaker.allow():
            return
        namespace = self._namespaces.get(request_id, self._settings.namespace)
        sid = self.planner.sequence_id(request_id).split(",")[0]
        if not sid:
            return
        ns = rank_namespace(namespace, 0, self._world_size)

        def stats():
            return self._clients.get(ns).stats(
                sid, deadline=self._settings.scheduler_deadline_seconds).num_tokens
        future = self._pool.submit(stats)
        try:
            self.planner.refresh(request_id,
                                 future.result(timeout=self._settings.lookup_wait_seconds))
            self._note(None)
        except KvqError as e:
            self._note(e)
        except Exception:  # noqa: BLE001  A timeout: the request recomputes instead.
            pass

    # ------------------------------------------------------------ finish

    def finished(self, request_id: str) -> None:
        """Forgets a request. Sequences the workers saw are theirs to release
        after their last commit; the others are released here (in the
        background)."""
        self._pending.pop(request_id, None)  # A lookup holds nothing on the server.
        self._prompts.pop(request_id, None)
        creating = self._creating.pop(request_id, (None, 0))[0]
        if self.ledger is not None:
            self.ledger.finished(request_id)
        namespace = self._namespaces.pop(request_id, None)
        sequence_ids = self.planner.finish(request_id)
        if request_id in self._seen_by_workers:
            self._seen_by_workers.discard(request_id)
            return
        if not self._settings.release_on_finish or namespace is None:
            return
        if creating is not None:  # Still being created: release when it is.
            creating.add_done_callback(lambda f: self._release_created(f, namespace))
        elif sequence_ids:
            self._pool.submit(self._release_all, namespace, sequence_ids)

    def _release_created(self, future: Future, namespace: str) -> None:
        if not future.cancelled() and future.exception() is None:
            self._release_all(namespace, future.result()[0])

    def _release_all(self, namespace: str, sequence_ids: str) -> None:
        for rank, sid in enumerate(sequence_ids.split(",")):
            self._release(rank_namespace(namespace, rank, self._world_size), sid)

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: this engine stops finding what kvq
        holds (a new namespace epoch; the old prefixes age out of kvq by
        lease and eviction). Requests in flight keep their sequences."""
        self._epoch += 1
        if self.ledger is not None:
            self.ledger.reset()
            self._probes.clear()
        return True

    # ------------------------------------------------------------ events

    def worker_reports(self, saved: Dict[str, int], failed: Dict[str, int],
                       released: Dict[str, int]) -> None:
        """What the workers reported (vllm_worker.WorkerReports, summed over
        ranks): saves committed or failed, sequences released. Starts the
        ledger's release probes in the background."""
        if self.ledger is None:
            return
        self._start_probes(self.ledger.acknowledged(saved, failed, released))

    def _start_probes(self, probes: List[Probe]) -> None:
        for probe in probes:
            if not self.breaker.allow():  # kvq is being skipped: nothing learned.
                self.ledger.probed(probe, None)
                continue
            self._probes.append((probe, self._probe_pool.submit(self._match, probe.namespace,
                                                                probe.token_ids)))

    def take_events(self) -> List[Any]:
        """The ledger's events since the last call (vllm_events.Stored and
        Removed), with the answers of the release probes that came back."""
        if self.ledger is None:
            return []
        audit = self._settings.events_audit_seconds
        if audit > 0 and time.monotonic() >= self._next_audit:
            self._next_audit = time.monotonic() + audit
            self._start_probes(self.ledger.audit())
        waiting = []
        for probe, future in self._probes:
            if not future.done():
                waiting.append((probe, future))
                continue
            error = future.exception()
            self._note(error)
            self.ledger.probed(probe, None if error else future.result()[0])
        self._probes = waiting
        return self.ledger.take()

    def wait_for_probes(self, timeout: float) -> None:
        """Waits until the release probes in flight answered (tests)."""
        for _, future in list(self._probes):
            try:
                future.result(timeout=timeout)
            except Exception:  # noqa: BLE001  take_events reads it.
                pass

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        self._clients.close()
