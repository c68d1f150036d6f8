"""The scheduler-side bookkeeping of the vLLM connector (vllm_connector.py),
without vLLM or torch: which tokens of which request a worker loads from kvq
or saves to it in one engine step.

Per request the connector holds one kvq sequence, created at the first
lookup with the prompt's token ids, so it starts with the longest prefix of
whole kvq blocks some earlier request stored under the same namespace,
layout and scheme (kvq's chained hash of the token pages). That prefix is
what vLLM may load; the sequence then receives the prompt tokens past it as
vLLM computes them (or finds them in its own prefix cache), so a later
request with the same prefix finds them too.

Token ranges are [begin, end) positions in the request; `block_ids` are the
request's vLLM block ids from position 0 (block i holds positions
[i * block_size, (i + 1) * block_size)).
"""

import dataclasses
from typing import Dict, List, Optional, Sequence


@dataclasses.dataclass
class TokenRange:
    """Tokens [begin, end) of a request's kvq sequence and where they live in
    vLLM's paged cache."""
    request_id: str
    sequence_id: str
    begin: int
    end: int
    block_ids: List[int]
    # Ids of the tokens past the prompt in [begin, end) (a save of generated
    # tokens): kvq registers their blocks for prefix reuse (multi-turn chat).
    token_ids: List[int] = dataclasses.field(default_factory=list)
    # The kvq namespace of the request (its cache salt and LoRA folded in);
    # the connector fills it in. `sequence_id` lists one sequence per
    # tensor-parallel rank, comma-separated.
    namespace: str = ""


@dataclasses.dataclass
class StepPlan:
    loads: List[TokenRange] = dataclasses.field(default_factory=list)
    saves: List[TokenRange] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Request:
    sequence_id: str
    prompt_len: int
    stored: int                  # Tokens kvq holds or receives by the saves planned so far.
    matched: int                 # Tokens kvq held when the sequence was created.
    lookup_computed: int = 0     # vLLM's local hit at the last lookup.
    pending_load: Optional[int] = None  # num_external_tokens granted, not yet planned.
    block_ids: List[int] = dataclasses.field(default_factory=list)
    # The request's token ids as vLLM grows them (prompt, then generated).
    all_token_ids: Sequence[int] = ()
    saving: bool = True          # False: its sequences could not be created.


class StepPlanner:
    """One instance per scheduler connector. `save` and `load` follow the
    kv_role (producer saves, consumer loads, both do both). With
    `save_decode_tokens` > 0 generated tokens are saved too, once at least
    that many are computed and unsaved (0: prompt tokens only)."""

    def __init__(self, save: bool, load: bool, save_decode_tokens: int = 0):
        self.save = save
        self.load = load
        self.save_decode_tokens = save_decode_tokens
        self._requests: Dict[str, _Request] = {}

    def request_ids(self) -> List[str]:
        return list(self._requests)

    def track_tokens(self, request_id: str, all_token_ids: Sequence[int]) -> None:
        """The request's live token list (vLLM's Request.all_token_ids), read
        when generated tokens are saved."""
        r = self._requests.get(request_id)
        if r is not None:
            r.all_token_ids = all_token_ids

    def known(self, request_id: str) -> bool:
        return request_id in self._requests

    def prompt_len(self, request_id: str) -> int:
        r = self._requests.get(request_id)
        return r.prompt_len if r else 0

    def sequence_id(self, request_id: str) -> Optional[str]:
        r = self._requests.get(request_id)
        return r.sequence_id if r else None

    def add_request(self, request_id: str, sequence_id: str, prompt_len: int,
                    stored_tokens: int) -> None:
        """Records a looked-up request: `sequence_id` its kvq sequences ("":
        not created yet, see set_sequence), `stored_tokens` what kvq holds of
        its prompt (MatchPrefix, or CreateSequenceResponse.num_tokens)."""
        self._requests[request_id] = _Request(sequence_id, prompt_len, stored_tokens,
                                              stored_tokens)

    def set_sequence(self, request_id: str, sequence_id: str,
                     stored_tokens: Optional[int]) -> None:
        """The sequences created for a looked-up request (after allocation)
        and the tokens they started with (CreateSequenceResponse.num_tokens),
        or "" and None where creation failed: its planned load then fails on
        the workers (vLLM recomputes) and nothing of it is saved. A creation
        that found less than the lookup lowers what later loads rely on."""
        r = self._requests.get(request_id)
        if r is None:
            return
        r.sequence_id = sequence_id
        if stored_tokens is None:
            r.saving = False
            return
        r.matched = min(r.matched, stored_tokens)
        r.stored = stored_tokens  # No save is planned before the sequence exists.

    def saved_past_match(self, request_id: str) -> bool:
        """Whether saves were planned past the tokens kvq held at creation: a
        request looked up again (after a preemption) may then load more; the
        caller asks kvq how many it holds and calls refresh()."""
        r = self._requests.get(request_id)
        return r is not None and self.load and r.stored > r.matched

    def refresh(self, request_id: str, stored_tokens: int) -> None:
        """kvq now holds `stored_tokens` of the request (Stats): up to the
        saves planned so far, that is what a later load may take."""
        r = self._requests.get(request_id)
        if r is not None:
            r.matched = max(r.matched, min(stored_tokens, r.stored))

    def matched_tokens(self, request_id: str, num_tokens: int, num_computed: int) -> int:
        """Tokens past vLLM's local hit `num_computed` that kvq can supply.
        vLLM must compute at least one token of the request itself (its
        logits), so the hit stops one short of `num_tokens`."""
        r = self._requests.get(request_id)
        if r is None or not self.load:
            return 0
        r.lookup_computed = num_computed
        usable = min(r.matched, num_tokens - 1)
        return max(0, usable - num_computed)

    def after_alloc(self, request_id: str, num_external_tokens: int) -> None:
        r = self._requests.get(request_id)
        if r is not None:
            r.pending_load = num_external_tokens if num_external_tokens > 0 else None

    def scheduled(self, plan: StepPlan, request_id: str, block_ids: Optional[List[int]],
                  replace_blocks: bool, num_computed: int, num_scheduled: int) -> None:
        """One scheduled request of this step: `block_ids` are its new blocks
        (all of them when `replace_blocks`: a new or resumed request),
        `num_computed` its computed tokens before the step, including a load
        granted this step, `num_scheduled` the tokens it computes in it."""
        r = self._requests.get(request_id)
        if r is None:
            return
        if replace_blocks:
            r.block_ids = list(block_ids or [])
        elif block_ids:
            r.block_ids.extend(block_ids)
        if r.pending_load is not None:
            begin = r.lookup_computed
            plan.loads.append(TokenRange(request_id, r.sequence_id, begin,
                                         begin + r.pending_load, list(r.block_ids)))
            r.pending_load = None
        end = min(num_computed + num_scheduled, r.prompt_len)
        token_ids: List[int] = []
        if r.stored >= r.prompt_len and self.save_decode_tokens > 0:
            # Generated tokens: in chunks, with their ids. The step computes
            # the KV of its input tokens, whose ids vLLM already holds.
            computed = min(num_computed + num_scheduled, len(r.all_token_ids))
            if computed - r.stored >= self.save_decode_tokens:
                end = computed
                token_ids = [int(t) for t in r.all_token_ids[r.stored:end]]
        if self.save and r.saving and end > r.stored:
            plan.saves.append(TokenRange(request_id, r.sequence_id, r.stored, end,
                                         list(r.block_ids), token_ids))
            r.stored = end

    def finish(self, request_id: str) -> Optional[str]:
        """Forgets a request; returns its kvq sequence id (None if unknown)."""
        r = self._requests.pop(request_id, None)
        return r.sequence_id if r else None
