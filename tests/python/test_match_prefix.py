"""MatchPrefix, the read-only prefix probe, against the real kvq-server: it
answers what a CreateSequence would reuse and leaves the server as it was.

Needs the server binary: $KVQ_SERVER_BIN (ctest sets it), else skipped."""

import grpc
import numpy as np
import pytest

from kvq_client import KvqClient, KvqError, ModelLayout, RopeParams
from live_server import needs_server, server_fixture

pytestmark = needs_server

LAYERS, HEADS, QHEADS, DIM = 2, 2, 4, 64
SCHEME = "kivi2:sink=4"  # Blocks of 128 tokens after a sink of 4.
PROMPT = [int(t) for t in np.random.default_rng(7).integers(0, 50000, 600)]


address = server_fixture("--capacity_bytes=268435456", "--backend=cpu")


@pytest.fixture(scope="module")
def saved(address):
    """A client whose namespace holds PROMPT's 600 tokens (sequence "src")."""
    with KvqClient(address, namespace="mp") as c:
        c.create_sequence(layout(), scheme=SCHEME, sequence_id="src", prompt_token_ids=PROMPT)
        rng = np.random.default_rng(0)
        k = rng.standard_normal((LAYERS, HEADS, len(PROMPT), DIM)).astype(np.float32)
        c.append_prompt("src", k, k)  # The ids came with the create.
        yield c


def layout():
    return ModelLayout(LAYERS, HEADS, QHEADS, DIM, RopeParams(theta=500000.0))


def test_match_prefix_answers_the_stored_whole_blocks(saved):
    m = saved.match_prefix(layout(), scheme=SCHEME, prompt_token_ids=PROMPT + [1, 2, 3])
    assert (m.matched_tokens, m.block_tokens) == (4 + 4 * 128, 128)
    assert saved.match_prefix(layout(), SCHEME, PROMPT[:300]).matched_tokens == 4 + 2 * 128
    assert saved.match_prefix(layout(), SCHEME, PROMPT[:131]).matched_tokens == 0
    other = [PROMPT[0] + 1] + PROMPT[1:]
    assert saved.match_prefix(layout(), SCHEME, other).matched_tokens == 0
    # Another scheme or layout stores other bytes: nothing to reuse.
    assert saved.match_prefix(layout(), "kivi4:sink=4", PROMPT).matched_tokens == 0
    wider = ModelLayout(LAYERS, HEADS, QHEADS, 128, RopeParams(theta=500000.0))
    assert saved.match_prefix(wider, SCHEME, PROMPT).matched_tokens == 0
    # CreateSequence reuses exactly what the probe announced.
    probe = saved.match_prefix(layout(), SCHEME, PROMPT[:400]).matched_tokens
    seq = saved.create_sequence(layout(), scheme=SCHEME, prompt_token_ids=PROMPT[:400])
    assert seq.num_tokens == probe == 4 + 3 * 128
    saved.release(seq.sequence_id)


def test_match_prefix_is_per_namespace(address, saved):
    with KvqClient(address, namespace="mp-other") as other:
        assert other.match_prefix(layout(), SCHEME, PROMPT).matched_tokens == 0


def test_lookups_leave_the_server_exactly_as_it_was(saved):
    before = saved.stats()
    for i in range(50):
        m = saved.match_prefix(layout(), SCHEME, PROMPT[:200 + 8 * i])
        assert m.matched_tokens > 0
    after = saved.stats()
    assert after.sequences == before.sequences
    assert after.used_bytes == before.used_bytes
    assert after.pages_used == before.pages_used
    assert after == before


def test_bad_fields_are_invalid_argument(saved):
    with pytest.raises(KvqError) as e:
        saved.match_prefix(layout(), "kivi9:" + "x" * 5000, PROMPT)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(e.value.details) < 400
    with pytest.raises(KvqError) as e:
        saved.match_prefix(ModelLayout(LAYERS, HEADS, QHEADS, 0), SCHEME, PROMPT)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "head_dim" in e.value.details
