"""KV events of the vLLM connector (vllm_connector.py) for KV-aware routers,
without vLLM: which of vLLM's blocks kvq holds for this engine, announced
when kvq acknowledged them and taken back when the connector learns they
are gone.

A block is announced (Stored) once every tensor-parallel rank's worker
reported the save that completes it committed, and only where kvq can
serve it as a prefix: whole kvq blocks (sink + k * block_tokens tokens).
A save that fails or is dropped is never announced.

kvq does not tell its clients what it evicts, so a block is taken back
(Removed) where the connector sees that kvq no longer serves it:
- a lookup (MatchPrefix) or a sequence creation of a later request whose
  prompt covers announced blocks of a finished request and finds fewer;
- a probe of a finished request's prompt after its sequences were released
  (kvq-server without --evict drops them at once; with it they stay as
  prefix cache), repeated as an audit while they stay (audit());
- reset_cache: every block announced (the engine moves to a new namespace
  epoch and no longer finds them).
Evictions (lease expiry, pool pressure) of blocks no later lookup or audit
probe touches stay unannounced until one does.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple


@dataclasses.dataclass
class Stored:
    """vLLM blocks [first, last) of a request that kvq now serves."""
    request_id: str
    block_hashes: List[Any]
    parent_block_hash: Any
    token_ids: List[int]
    extra: Any  # What the connector attached to the request (its LoRA).


@dataclasses.dataclass
class Removed:
    block_hashes: List[Any]


@dataclasses.dataclass
class Probe:
    """A read-only MatchPrefix the scheduler runs for the ledger: how many of
    `token_ids` kvq serves under `namespace`; the answer goes to
    BlockLedger.probed with `tick`."""
    request_id: str
    namespace: str
    token_ids: List[int]
    tick: int


def scheme_sink(scheme: str) -> int:
    """The sink tokens of a kvq scheme string ("kivi4:g32:r128:sink=4" -> 4)."""
    m = re.search(r"(?:^|:)sink=(\d+)", scheme)
    return int(m.group(1)) if m else 0


def save_key(request_id: str, end: int) -> str:
    """How a worker names a save in its acknowledgements."""
    return f"{end}:{request_id}"


def parse_save_key(key: str) -> Tuple[str, int]:
    end, request_id = key.split(":", 1)
    return request_id, int(end)


@dataclasses.dataclass
class _Chain:
    """One request's blocks as vLLM hashes them, and what kvq holds of it."""
    namespace: str
    block_hashes: Sequence[Any]   # vLLM's live list (grows with the request).
    token_ids: Sequence[int]      # vLLM's live list (prompt, then generated).
    extra: Any
    announced: int = 0            # vLLM blocks [0, announced) announced or held before.
    acks: Dict[int, List[int]] = dataclasses.field(default_factory=dict)  # end -> [ok, failed]
    broken: bool = False          # A save failed: later ones are dropped too.
    finished: bool = False
    released: int = 0             # Ranks whose workers released its sequences.


class BlockLedger:
    """One per scheduler connector. `block_size` is vLLM's; `sink` and kvq's
    block (learned from the first MatchPrefix or CreateSequence answer) give
    the prefix granularity. At most `max_blocks` announced hashes are
    remembered (the oldest are forgotten, without an event), and at most
    `audit_prefixes` finished requests' prefixes are audited."""

    def __init__(self, block_size: int, world_size: int = 1, sink: int = 0,
                 expect_release: bool = True, max_blocks: int = 1 << 20,
                 audit_prefixes: int = 0):
        self._bs = block_size
        self._world = world_size
        self._sink = sink
        self._expect_release = expect_release  # kvq_release_on_finish.
        self._kvq_block: Optional[int] = None
        self._max_blocks = max_blocks
        # Announced hash -> (tick, request that announced it).
        self._announced: "collections.OrderedDict[Any, Tuple[int, str]]" = \
            collections.OrderedDict()
        self._chains: Dict[str, _Chain] = {}
        self._probing: Dict[str, _Chain] = {}  # Released requests, probe in flight.
        # Released requests whose announced blocks kvq still held, oldest
        # audited first.
        self._audited: "collections.OrderedDict[str, _Chain]" = collections.OrderedDict()
        self._audit_prefixes = audit_prefixes
        self._tick = 0
        self._events: List[Any] = []

    # ------------------------------------------------------------ inputs

    def learn_block_tokens(self, block_tokens: int) -> None:
        if block_tokens > 0:
            self._kvq_block = block_tokens

    def tick(self) -> int:
        """Take before a lookup starts: only blocks announced before it can
        be taken back by its answer."""
        return self._tick

    def track(self, request_id: str, namespace: str, block_hashes: Sequence[Any],
              token_ids: Sequence[int], extra: Any = None, held_tokens: int = 0) -> None:
        """A request whose saves may be announced; `held_tokens` kvq served it
        (its hit): those blocks are not announced again."""
        chain = _Chain(namespace, block_hashes, token_ids, extra)
        chain.announced = min(held_tokens // self._bs, len(block_hashes))
        self._chains[request_id] = chain

    def set_token_ids(self, request_id: str, token_ids: Sequence[int]) -> None:
        chain = self._chains.get(request_id)
        if chain is not None:
            chain.token_ids = token_ids

    def planned(self, request_id: str, end: int) -> None:
        """A save of the request's tokens up to `end` went into a step's plan."""
        chain = self._chains.get(request_id)
        if chain is not None and not chain.broken:
            chain.acks.setdefault(end, [0, 0])

    def acknowledged(self, saved: Dict[str, int], failed: Dict[str, int],
                     released: Dict[str, int]) -> List[Probe]:
        """The workers' reports of one or more steps (summed over ranks): saves
        committed or failed (save_key), requests whose sequences they
        released. Returns the probes to run (released, finished requests)."""
        for key, n in saved.items():
            self._ack(key, ok=n)
        for key, n in failed.items():
            self._ack(key, failed=n)
        probes = []
        for request_id, n in released.items():
            chain = self._chains.get(request_id)
            if chain is None:
                continue
            chain.released += n
            if chain.released >= self._world and chain.finished:
                probe = self._release_probe(request_id, chain)
                if probe is not None:
                    probes.append(probe)
        return probes

    def _ack(self, key: str, ok: int = 0, failed: int = 0) -> None:
        request_id, end = parse_save_key(key)
        chain = self._chains.get(request_id)
        if chain is None or end not in chain.acks:
            return
        counts = chain.acks[end]
        counts[0] += ok
        counts[1] += failed
        if counts[1]:
            # Not on every rank: kvq's prefix match takes the least rank's.
            chain.broken = True
            chain.acks.clear()
        else:
            # Saves commit in order: announce every leading save all ranks committed.
            for e in sorted(chain.acks):
                if chain.acks[e][0] < self._world:
                    break
                del chain.acks[e]
                self._announce(request_id, chain, e)
        self._drop_if_settled(request_id, chain)

    def _drop_if_settled(self, request_id: str, chain: _Chain) -> None:
        """A finished request's chain is kept until its saves are settled and,
        if it announced blocks, its sequences released (then probed)."""
        if not chain.finished or chain.acks:
            return
        if not self._expect_release or not self._owns_any(request_id, chain):
            del self._chains[request_id]

    def _owns_any(self, request_id: str, chain: _Chain) -> bool:
        return any(self._announced.get(h, (0, ""))[1] == request_id
                   for h in chain.block_hashes[:chain.announced])

    def _reusable(self, tokens: int) -> int:
        """Leading tokens of `tokens` stored ones that kvq serves as a prefix."""
        block = self._kvq_block
        if not block or tokens < self._sink + block:
            return 0
        return self._sink + (tokens - self._sink) // block * block

    def _announce(self, request_id: str, chain: _Chain, end: int) -> None:
        last = min(self._reusable(end) // self._bs, len(chain.block_hashes))
        if last <= chain.announced:
            return
        first, chain.announced = chain.announced, last
        self._tick += 1
        run_start = None
        for i in range(first, last + 1):
            new = i < last and chain.block_hashes[i] not in self._announced
            if new and run_start is None:
                run_start = i
            elif not new and run_start is not None:
                self._stored_event(request_id, chain, run_start, i)
                run_start = None
        self._forget_oldest()

    def _stored_event(self, request_id: str, chain: _Chain, first: int, last: int) -> None:
        hashes = list(chain.block_hashes[first:last])
        for h in hashes:
            self._announced[h] = (self._tick, request_id)
        self._events.append(Stored(
            request_id, hashes, chain.block_hashes[first - 1] if first else None,
            [int(t) for t in chain.token_ids[first * self._bs:last * self._bs]], chain.extra))

    def _forget_oldest(self) -> None:
        while len(self._announced) > self._max_blocks:
            self._announced.popitem(last=False)

    def finished(self, request_id: str) -> None:
        """The request finished: its chain waits for the workers' release (or
        is dropped if it announced nothing)."""
        chain = self._chains.get(request_id)
        if chain is None:
            return
        chain.finished = True
        # Saves still unacknowledged: the workers report them before the release.
        self._drop_if_settled(request_id, chain)

    def _release_probe(self, request_id: str, chain: _Chain) -> Optional[Probe]:
        del self._chains[request_id]
        return self._probe(request_id, chain)

    def _probe(self, request_id: str, chain: _Chain) -> Optional[Probe]:
        tokens = self._reusable(chain.announced * self._bs)
        if not tokens:
            return None
        # The chain's blocks, remembered for probed().
        self._probing[request_id] = chain
        return Probe(request_id, chain.namespace, [int(t) for t in chain.token_ids[:tokens]],
                     self._tick)

    def probed(self, probe: Probe, matched_tokens: Optional[int]) -> None:
        """The answer to a release or audit probe (None: it failed; nothing
        learned). A prefix of which kvq still holds announced blocks is
        audited again later."""
        chain = self._probing.pop(probe.request_id, None)
        if chain is None:
            return
        if matched_tokens is not None:
            self._gone(chain.block_hashes[:chain.announced], matched_tokens, probe.tick,
                       len(probe.token_ids), owners_finished=True)
        if self._audit_prefixes and self._owns_any(probe.request_id, chain):
            self._audited[probe.request_id] = chain
            while len(self._audited) > self._audit_prefixes:
                self._audited.popitem(last=False)

    def audit(self) -> List[Probe]:
        """Probes of every audited prefix (its blocks announced and, when last
        probed, still held); their answers go to probed()."""
        probes = []
        for request_id in list(self._audited):
            probe = self._probe(request_id, self._audited.pop(request_id))
            if probe is not None:
                probes.append(probe)
        return probes

    def served(self, block_hashes: Sequence[Any], num_prompt_tokens: int,
               matched_tokens: int, tick: int) -> None:
        """kvq served `matched_tokens` of a prompt with these block hashes (a
        lookup, or the tokens its sequence started with) when `tick` was
        current: announced blocks of finished requests it should have
        served and did not are gone."""
        self._gone(block_hashes, matched_tokens, tick, num_prompt_tokens,
                   owners_finished=False)

    def served_request(self, request_id: str, num_prompt_tokens: int, matched_tokens: int,
                       tick: int) -> None:
        """As served(), for a tracked request (its sequence's creation, which
        may find less than its lookup did: those blocks are then its to
        save, and to announce)."""
        chain = self._chains.get(request_id)
        if chain is None:
            return
        chain.announced = min(chain.announced, matched_tokens // self._bs)
        self.served(chain.block_hashes, num_prompt_tokens, matched_tokens, tick)

    def _gone(self, block_hashes: Sequence[Any], matched: int, tick: int, prompt_tokens: int,
              owners_finished: bool) -> None:
        # Block i is served iff kvq matched past its end, where the prompt
        # reaches a kvq block boundary at or past it.
        bound = min(self._reusable(prompt_tokens) // self._bs, len(block_hashes))
        removed = []
        for i in range(matched // self._bs, bound):
            h = block_hashes[i]
            entry = self._announced.get(h)
            if entry is None or entry[0] > tick:
                continue  # Not ours, or announced after the lookup started.
            owner = self._chains.get(entry[1])
            if not owners_finished and owner is not None and not owner.finished:
                # Its sequence may be taking an Append (kvq serves no prefix
                # from a sequence mid-append); its release probe decides.
                continue
            del self._announced[h]
            removed.append(h)
        if removed:
            self._events.append(Removed(removed))

    def reset(self) -> None:
        """reset_cache: every announced block is taken back; saves in flight
        (in the old namespace epoch) are never announced."""
        if self._announced:
            self._events.append(Removed(list(self._announced)))
        self._announced.clear()
        self._chains.clear()
        self._probing.clear()
        self._audited.clear()
        self._tick += 1

    def forget(self, request_id: str) -> None:
        self._chains.pop(request_id, None)

    def take(self) -> List[Any]:
        events, self._events = self._events, []
        return events

    def announced_hashes(self) -> List[Any]:
        return list(self._announced)
