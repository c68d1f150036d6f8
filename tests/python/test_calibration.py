"""CreateSequence's and MatchPrefix's `calibration` through the Python
client against the real kvq-server: the field reaches the server (its
refusals name it) for both wrappers.

Needs the server binary: $KVQ_SERVER_BIN (ctest sets it), else skipped."""

import grpc
import pytest

from kvq_client import KvqClient, KvqError, ModelLayout
from live_server import needs_server, running_server

pytestmark = needs_server

LAYOUT = ModelLayout(2, 2, 4, 64)


@pytest.fixture(scope="module")
def client():
    with running_server("--capacity_bytes=268435456", "--backend=cpu") as addr:
        with KvqClient(addr, namespace="cal") as c:
            yield c


def test_a_scheme_without_calibration_refuses_one(client):
    with pytest.raises(KvqError) as e:
        client.create_sequence(LAYOUT, scheme="kivi2", calibration="smollm2")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "calibration: scheme \"kivi2:g32:r128\" takes no calibration" in e.value.details
    with pytest.raises(KvqError) as e:
        client.match_prefix(LAYOUT, scheme="kivi2", prompt_token_ids=[1, 2], calibration="x")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_crq_scheme_names_a_loaded_calibration(client):
    with pytest.raises(KvqError) as e:
        client.create_sequence(LAYOUT, scheme="crq3:pre_rope", calibration="smollm2")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert "calibration \"smollm2\" is not loaded on this server" in e.value.details
    with pytest.raises(KvqError) as e:
        client.create_sequence(LAYOUT, scheme="crq3:pre_rope")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details.startswith("calibration: scheme \"crq3")
    with pytest.raises(KvqError) as e:
        client.match_prefix(LAYOUT, scheme="crq3:pre_rope", prompt_token_ids=[1],
                            calibration="smollm2")
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert list(client.info().calibrations) == []
