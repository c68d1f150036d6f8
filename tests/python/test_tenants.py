"""The Python client's bearer token against a kvq-server with --tokens_file:
unary calls, the Append and FetchDequant streams and DecodeStream all carry
it; without it or with another tenant's, the answers of docs/SECURITY.md.

Needs the server binary: $KVQ_SERVER_BIN (ctest sets it), else skipped."""

import os
import tempfile

import numpy as np
import pytest

from kvq_client import DecodeItem, KvqClient, KvqError, ModelLayout
from live_server import needs_server, running_server

pytestmark = needs_server

LAYERS, HEADS, QHEADS, DIM = 2, 2, 4, 64
TOKEN_A = "python-tenant-a-token-01234"
TOKEN_B = "python-tenant-b-token-56789"


@pytest.fixture(scope="module")
def address():
    with tempfile.TemporaryDirectory() as tmp:
        tokens = os.path.join(tmp, "tokens")
        with open(tokens, "w") as f:
            f.write(f"tenant=a token={TOKEN_A}\ntenant=b token={TOKEN_B} quota_bytes=16384\n")
        with running_server("--metrics_address=", "--capacity_bytes=268435456", "--backend=cpu",
                            f"--tokens_file={tokens}") as addr:
            yield addr


def test_token_on_every_call_and_stream(address):
    rng = np.random.default_rng(1)
    k = rng.standard_normal((LAYERS, HEADS, 40, DIM)).astype(np.float16)
    with KvqClient(address, namespace="py", token=TOKEN_A) as a:
        a.create_sequence(ModelLayout(LAYERS, HEADS, QHEADS, DIM), scheme="fp16",
                          sequence_id="s")
        a.append_prompt("s", k, k)  # Client stream.
        fk, fv = a.fetch("s")  # Server stream.
        assert (fk == k).all() and (fv == k).all()
        with a.decode_session() as session:  # Bidirectional stream.
            item = DecodeItem("s", k[0, :, :1], k[0, :, :1],
                              rng.standard_normal((1, QHEADS, DIM)).astype(np.float32))
            [(out, _)] = session.step(0, [item])
            assert out.shape == (1, QHEADS, DIM)
        assert a.stats("s").num_tokens == 40  # Layer 0 got one more; every layer has 40.
    with KvqClient(address, namespace="py", token=TOKEN_B) as b:
        with pytest.raises(KvqError) as e:
            b.stats("s")
        assert e.value.code.name == "NOT_FOUND"
        assert e.value.details == 'sequence "s" in namespace "py" does not exist'
        assert b.stats().sequences == 0
        b.create_sequence(ModelLayout(LAYERS, HEADS, QHEADS, DIM), scheme="fp16",
                          sequence_id="s")
        with pytest.raises(KvqError) as e:
            b.append_prompt("s", k, k)
        assert e.value.code.name == "RESOURCE_EXHAUSTED"
        # The prompt went as raw pages (quantized by the client), whose
        # error names the stream that hit the quota.
        assert e.value.details.startswith(
            'layer 1 kv_head 0: tenant "b" is over its quota: quota_bytes = 16384, used ')
        assert b.stats("s").num_tokens == 0


def test_health_and_reflection_stay_open(address):
    import grpc
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        assert check(b"", timeout=30) == b"\x08\x01"  # HealthCheckResponse{status: SERVING}
        # Reflection too: ServerReflectionRequest{list_services: ""} lists the API.
        reflect = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        reply = next(iter(reflect(iter([b"\x3a\x00"]), timeout=30)))
        assert b"kvq.v1.KvCache" in reply


def test_missing_or_bad_token(address):
    with KvqClient(address) as none:
        with pytest.raises(KvqError) as e:
            none.info()
        assert e.value.code.name == "UNAUTHENTICATED"
        assert e.value.details == (
            'this server needs "authorization: Bearer <token>" metadata on every call')
    with KvqClient(address, token="not-a-valid-token-at-all") as bad:
        with pytest.raises(KvqError) as e:
            bad.stats()
        assert e.value.code.name == "UNAUTHENTICATED"
        assert e.value.details == "the bearer token is not valid"
