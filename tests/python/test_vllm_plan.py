"""StepPlanner (kvq_client/vllm_plan.py): the vLLM connector's scheduler-side
bookkeeping, without vLLM."""

from kvq_client.vllm_plan import StepPlan, StepPlanner, TokenRange


def plan_step(planner, *scheduled):
    plan = StepPlan()
    for args in scheduled:
        planner.scheduled(plan, *args)
    return plan


def test_lookup_offers_kvq_prefix_past_the_local_hit_and_one_token_short_of_the_end():
    p = StepPlanner(save=True, load=True)
    p.add_request("r", "s", prompt_len=300, stored_tokens=256)
    assert p.matched_tokens("r", num_tokens=300, num_computed=0) == 256
    assert p.matched_tokens("r", num_tokens=300, num_computed=128) == 128
    assert p.matched_tokens("r", num_tokens=300, num_computed=272) == 0
    p.add_request("all", "s2", prompt_len=256, stored_tokens=256)
    assert p.matched_tokens("all", num_tokens=256, num_computed=0) == 255
    assert p.matched_tokens("unknown", num_tokens=10, num_computed=0) == 0


def test_producer_only_never_loads_consumer_only_never_saves():
    producer = StepPlanner(save=True, load=False)
    producer.add_request("r", "s", 100, 64)
    assert producer.matched_tokens("r", 100, 0) == 0
    consumer = StepPlanner(save=False, load=True)
    consumer.add_request("r", "s", 100, 64)
    assert consumer.matched_tokens("r", 100, 0) == 64
    consumer.after_alloc("r", 64)
    plan = plan_step(consumer, ("r", [1, 2, 3, 4, 5, 6, 7], True, 64, 36))
    assert plan.loads == [TokenRange("r", "s", 0, 64, [1, 2, 3, 4, 5, 6, 7])]
    assert plan.saves == []


def test_chunked_prefill_saves_each_chunk_once_and_no_decode_tokens():
    p = StepPlanner(save=True, load=True)
    p.add_request("r", "s", prompt_len=300, stored_tokens=0)
    assert p.matched_tokens("r", 300, 0) == 0
    p.after_alloc("r", 0)
    s1 = plan_step(p, ("r", list(range(1, 9)), True, 0, 128))
    s2 = plan_step(p, ("r", list(range(9, 17)), False, 128, 128))
    s3 = plan_step(p, ("r", [17, 18, 19], False, 256, 44))
    s4 = plan_step(p, ("r", None, False, 300, 1))
    assert s1.loads == s2.loads == s3.loads == s4.loads == []
    assert [(r.begin, r.end, len(r.block_ids)) for r in s1.saves + s2.saves + s3.saves] == \
        [(0, 128, 8), (128, 256, 16), (256, 300, 19)]
    assert s3.saves[0].block_ids == list(range(1, 20))
    assert s4.saves == []


def test_load_then_save_past_the_loaded_prefix_with_the_full_block_list():
    p = StepPlanner(save=True, load=True)
    p.add_request("r", "s", prompt_len=320, stored_tokens=256)
    assert p.matched_tokens("r", 320, 0) == 256
    p.after_alloc("r", 256)
    blocks = list(range(1, 21))
    s1 = plan_step(p, ("r", blocks, True, 256, 64))
    assert s1.loads == [TokenRange("r", "s", 0, 256, blocks)]
    assert s1.saves == [TokenRange("r", "s", 256, 320, blocks)]
    s2 = plan_step(p, ("r", [21], False, 320, 1))
    assert s2.loads == [] and s2.saves == []


def test_local_hit_beyond_kvq_is_saved_from_the_paged_cache():
    # vLLM's own prefix cache holds 160 tokens, kvq 128: the worker saves
    # [128, 160) from the local blocks along with the computed tokens.
    p = StepPlanner(save=True, load=True)
    p.add_request("r", "s", prompt_len=200, stored_tokens=128)
    assert p.matched_tokens("r", 200, 160) == 0
    p.after_alloc("r", 0)
    s = plan_step(p, ("r", list(range(13)), True, 160, 40))
    assert s.loads == []
    assert s.saves == [TokenRange("r", "s", 128, 200, list(range(13)))]


def test_resumed_request_replaces_its_blocks_and_is_not_saved_twice():
    p = StepPlanner(save=True, load=True)
    p.add_request("r", "s", prompt_len=64, stored_tokens=0)
    p.matched_tokens("r", 64, 0)
    p.after_alloc("r", 0)
    plan_step(p, ("r", [1, 2, 3, 4], True, 0, 64))
    # Preempted, then resumed with new blocks: recomputes, saves nothing new.
    s = plan_step(p, ("r", [7, 8, 9, 10], True, 0, 64))
    assert s.saves == []
    s = plan_step(p, ("r", [11], False, 64, 1))
    assert s.saves == []


def test_finish_forgets_the_request():
    p = StepPlanner(save=True, load=True)
    p.add_request("r", "s", 10, 0)
    assert p.known("r") and p.sequence_id("r") == "s"
    assert p.finish("r") == "s"
    assert not p.known("r") and p.finish("r") is None
    plan = plan_step(p, ("r", [1], True, 0, 10))
    assert plan.loads == [] and plan.saves == []


def test_preempted_request_may_load_what_it_saved():
    p = StepPlanner(save=True, load=True)
    p.add_request("r", "s", prompt_len=150, stored_tokens=0)
    assert not p.saved_past_match("r")  # Nothing planned yet: no need to ask kvq.
    p.after_alloc("r", 0)
    plan_step(p, ("r", list(range(10)), True, 0, 150))
    assert p.saved_past_match("r")
    p.refresh("r", 300)  # Never more than this request's planned saves.
    assert p.matched_tokens("r", num_tokens=160, num_computed=32) == 118
    p.refresh("r", 100)  # Never less than known before.
    assert p.matched_tokens("r", num_tokens=160, num_computed=0) == 150
    assert not p.saved_past_match("r")
    p.after_alloc("r", 150)
    s = plan_step(p, ("r", list(range(20, 30)), True, 150, 10))
    assert s.loads == [TokenRange("r", "s", 0, 150, list(range(20, 30)))]
    assert s.saves == []


def test_generated_tokens_are_saved_in_chunks_with_their_ids():
    # Multi-turn reuse: once 4 generated tokens are computed and unsaved they
    # go to kvq with their ids (kvq registers their blocks for the next turn).
    p = StepPlanner(save=True, load=True, save_decode_tokens=4)
    p.add_request("r", "s", prompt_len=10, stored_tokens=0)
    tokens = list(range(100, 110))
    p.track_tokens("r", tokens)
    p.after_alloc("r", 0)
    s = plan_step(p, ("r", [1], True, 0, 10))
    assert [(r.begin, r.end, r.token_ids) for r in s.saves] == [(0, 10, [])]
    saved = []
    for step in range(6):  # Decode: each step computes the token sampled last.
        tokens.append(200 + step)
        s = plan_step(p, ("r", None, False, 10 + step, 1))
        saved += [(r.begin, r.end, r.token_ids) for r in s.saves]
    # After the 4th decode step positions [10, 14) are computed.
    assert saved == [(10, 14, [200, 201, 202, 203])]


def test_generated_tokens_are_not_saved_when_turned_off():
    p = StepPlanner(save=True, load=True, save_decode_tokens=0)
    p.add_request("r", "s", prompt_len=10, stored_tokens=0)
    tokens = list(range(10))
    p.track_tokens("r", tokens)
    plan_step(p, ("r", [1], True, 0, 10))
    for step in range(20):
        tokens.append(step)
        assert plan_step(p, ("r", None, False, 10 + step, 1)).saves == []
