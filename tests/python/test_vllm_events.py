"""BlockLedger (kvq_client/vllm_events.py): which vLLM blocks the connector's
KV events announce as held by kvq, and when it takes them back; without
vLLM or a server (the server-backed checks are in test_vllm_halves.py)."""

from kvq_client.vllm_events import (BlockLedger, Removed, Stored, parse_save_key, save_key,
                                    scheme_sink)

BS = 16  # vLLM's block size.


def chain(tokens, salt=""):
    """Chained block hashes, as vLLM's: each covers its block and all before."""
    hashes, parent = [], salt
    for i in range(len(tokens) // BS):
        parent = hash((parent, tuple(tokens[i * BS:(i + 1) * BS])))
        hashes.append(parent)
    return hashes


def ledger(world=1, sink=0, kvq_block=32, **kw):
    ledger = BlockLedger(BS, world, sink, **kw)
    ledger.learn_block_tokens(kvq_block)
    return ledger


PROMPT = list(range(1000, 1100))  # 100 tokens: 6 whole vLLM blocks, 3 whole kvq blocks.
HASHES = chain(PROMPT)


def tracked(led, *ends):
    """Request "a" (PROMPT) tracked, with saves up to `ends` planned."""
    led.track("a", "ns", HASHES, PROMPT)
    for end in ends:
        led.planned("a", end)
    return led


def saved(ledger, request_id, end, ranks=1):
    return ledger.acknowledged({save_key(request_id, end): ranks}, {}, {})


def test_helpers():
    assert scheme_sink("kivi4:g32:r128:sink=4") == 4
    assert scheme_sink("int8") == 0 and scheme_sink("kivi2:sink=12:g32") == 12
    assert parse_save_key(save_key("req:with:colons", 96)) == ("req:with:colons", 96)


def test_a_save_is_announced_once_acknowledged_and_only_whole_kvq_blocks():
    led = ledger()
    tracked(led, 40, 100)
    assert led.take() == []  # Planned is not stored.
    saved(led, "a", 40)      # kvq serves 32 of 40 tokens: vLLM blocks 0 and 1.
    [first] = led.take()
    assert first == Stored("a", HASHES[0:2], None, PROMPT[0:32], None)
    saved(led, "a", 100)     # 96 of 100: blocks 2 to 5.
    [second] = led.take()
    assert second == Stored("a", HASHES[2:6], HASHES[1], PROMPT[32:96], None)
    assert led.announced_hashes() == HASHES[:6]


def test_a_sink_shifts_kvq_blocks():
    led = ledger(sink=4, kvq_block=128)
    tokens = list(range(300))
    hashes = chain(tokens)
    led.track("a", "ns", hashes, tokens)
    led.planned("a", 300)
    saved(led, "a", 300)     # kvq serves 4 + 2 * 128 = 260 tokens: 16 whole vLLM blocks.
    [event] = led.take()
    assert event.block_hashes == hashes[:16]
    led.track("b", "ns", chain(tokens[:100]), tokens[:100])
    led.planned("b", 100)
    saved(led, "b", 100)     # Under sink + one kvq block: nothing kvq can serve.
    assert led.take() == []


def test_a_failed_save_is_never_announced_nor_any_later_one():
    led = ledger()
    tracked(led, 40, 100)
    led.acknowledged({}, {save_key("a", 40): 1}, {})
    saved(led, "a", 100)     # A later commit cannot stand on a failed one.
    assert led.take() == [] and led.announced_hashes() == []


def test_tensor_parallel_saves_wait_for_every_rank_and_fail_on_any():
    led = ledger(world=2)
    tracked(led, 100)
    saved(led, "a", 100, ranks=1)
    assert led.take() == []
    saved(led, "a", 100, ranks=1)
    assert [e.block_hashes for e in led.take()] == [HASHES[:6]]
    led.track("b", "ns2", chain(PROMPT, "b"), PROMPT)
    led.planned("b", 100)
    led.acknowledged({save_key("b", 100): 1}, {save_key("b", 100): 1}, {})
    assert led.take() == []


def test_commits_are_announced_in_order():
    led = ledger()
    tracked(led, 40, 100)
    saved(led, "a", 100)     # Reported ahead of the earlier save: waits for it.
    assert led.take() == []
    saved(led, "a", 40)
    assert [e.block_hashes for e in led.take()] == [HASHES[:2], HASHES[2:6]]


def test_a_hit_is_not_announced_again_and_blocks_announced_once():
    led = ledger()
    tracked(led, 100)
    saved(led, "a", 100)
    led.take()
    # b got 64 tokens from kvq and saves 100 again (its own sequence).
    led.track("b", "ns", HASHES, PROMPT, held_tokens=64)
    led.planned("b", 100)
    saved(led, "b", 100)
    assert led.take() == []  # Blocks 4 and 5 were announced by a already.


def released(led, request_id, ranks=1):
    return led.acknowledged({}, {}, {request_id: ranks})


def test_release_probes_the_announced_prefix_and_takes_back_what_is_gone():
    led = ledger(world=2)
    tracked(led, 100)
    saved(led, "a", 100, ranks=2)
    led.take()
    led.finished("a")
    assert released(led, "a", ranks=1) == []  # Rank 1 still holds its sequence.
    [probe] = released(led, "a", ranks=1)
    assert (probe.namespace, probe.token_ids) == ("ns", PROMPT[:96])
    led.probed(probe, 32)   # kvq serves only the first kvq block now.
    assert led.take() == [Removed(HASHES[2:6])]
    assert led.announced_hashes() == HASHES[:2]


def test_a_release_that_kept_the_prefix_removes_nothing_and_a_failed_probe_learns_nothing():
    for answer in (96, None):
        led = ledger()
        led.track("a", "ns", HASHES, PROMPT)
        led.planned("a", 100)
        saved(led, "a", 100)
        led.take()
        led.finished("a")
        [probe] = released(led, "a")
        led.probed(probe, answer)
        assert led.take() == [] and led.announced_hashes() == HASHES[:6]


def test_the_last_save_acknowledged_after_finish_is_announced_then_probed():
    led = ledger()
    tracked(led, 100)
    led.finished("a")
    # The worker's FIFO: the commit is reported before the release.
    [probe] = led.acknowledged({save_key("a", 100): 1}, {}, {"a": 1})
    assert [e.block_hashes for e in led.take()] == [HASHES[:6]]
    assert probe.token_ids == PROMPT[:96]


def test_without_release_a_settled_request_is_forgotten():
    led = ledger(expect_release=False)
    tracked(led, 100)
    led.finished("a")
    saved(led, "a", 100)
    led.take()
    assert released(led, "a") == []


def test_a_lookup_that_finds_less_takes_back_finished_requests_blocks():
    led = ledger()
    tracked(led, 100)
    saved(led, "a", 100)
    led.take()
    # a still runs: its sequence may be mid-Append (kvq serves no prefix
    # from it then); its own release probe decides.
    led.served(HASHES, 100, 0, led.tick())
    assert led.take() == []
    led.finished("a")
    [probe] = released(led, "a")
    led.probed(probe, 96)
    # A 40-token prompt can only vouch for the first kvq block (blocks 0, 1).
    led.served(HASHES[:2], 40, 0, led.tick())
    assert led.take() == [Removed(HASHES[0:2])]
    led.served(HASHES, 100, 64, led.tick())
    assert led.take() == [Removed(HASHES[4:6])]


def test_a_lookup_started_before_an_announcement_does_not_take_it_back():
    led = ledger(expect_release=False)
    tick = led.tick()        # The lookup's MatchPrefix starts...
    tracked(led, 100)
    led.finished("a")
    saved(led, "a", 100)     # ...a commits and is announced...
    led.take()
    led.served(HASHES, 100, 0, tick)  # ...and the answer comes back.
    assert led.take() == []
    led.served(HASHES, 100, 0, led.tick())
    assert led.take() == [Removed(HASHES[:6])]


def test_a_creation_that_found_less_than_its_lookup_saves_and_announces_those_blocks():
    led = ledger(expect_release=False)
    led.track("a", "ns", HASHES, PROMPT, held_tokens=96)
    led.served_request("a", 100, 32, led.tick())
    led.planned("a", 100)
    saved(led, "a", 100)
    assert [e.block_hashes for e in led.take()] == [HASHES[2:6]]


def test_reset_takes_back_everything_and_drops_saves_in_flight():
    led = ledger()
    tracked(led, 40, 100)
    saved(led, "a", 40)
    led.take()
    led.reset()
    assert led.take() == [Removed(HASHES[:2])]
    saved(led, "a", 100)     # Saved under the old epoch: this engine no longer finds it.
    assert led.take() == [] and led.announced_hashes() == []


def test_memory_is_bounded_by_max_blocks():
    led = ledger(max_blocks=4, expect_release=False)
    tracked(led, 100)
    saved(led, "a", 100)
    assert led.announced_hashes() == HASHES[2:6]


def released_and_kept(led, request_id, hashes, prompt):
    """A request saved, announced, finished, released and found still held."""
    led.track(request_id, "ns", hashes, prompt)
    led.planned(request_id, len(prompt))
    saved(led, request_id, len(prompt))
    led.finished(request_id)
    [probe] = released(led, request_id)
    led.probed(probe, len(probe.token_ids))
    led.take()


def test_an_audit_reprobes_held_prefixes_until_kvq_drops_them():
    led = ledger(audit_prefixes=8)
    released_and_kept(led, "a", HASHES, PROMPT)
    [probe] = led.audit()
    assert led.audit() == []  # Its probe is in flight.
    led.probed(probe, 32)     # kvq evicted past its first kvq block.
    assert led.take() == [Removed(HASHES[2:6])]
    [probe] = led.audit()     # Blocks 0 and 1 are still announced: audited again.
    assert probe.token_ids == PROMPT[:96]
    led.probed(probe, None)   # A failed probe learns nothing, keeps auditing.
    [probe] = led.audit()
    led.probed(probe, 0)
    assert led.take() == [Removed(HASHES[0:2])]
    assert led.audit() == [] and led.announced_hashes() == []


def test_audits_keep_the_latest_prefixes_and_none_when_off():
    led = ledger(audit_prefixes=1)
    released_and_kept(led, "a", HASHES, PROMPT)
    other = list(range(5000, 5100))
    released_and_kept(led, "b", chain(other), other)
    assert [p.request_id for p in led.audit()] == ["b"]
    off = ledger()
    released_and_kept(off, "a", HASHES, PROMPT)
    assert off.audit() == []
