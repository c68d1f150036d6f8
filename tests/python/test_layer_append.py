"""LayerAppend (kvq_client/layer_append.py) against the real kvq-server:
one Append stream fed a layer at a time. Needs $KVQ_SERVER_BIN (ctest sets
it), else skipped."""

import grpc
import numpy as np
import pytest

from kvq_client import KvqClient, KvqError, ModelLayout
from kvq_client.layer_append import LayerAppend

from live_server import SERVER_BIN
from test_client_server import address  # noqa: F401  (the server fixture)

pytestmark = pytest.mark.skipif(not SERVER_BIN, reason="KVQ_SERVER_BIN is not set")

LAYERS, HEADS, DIM = 3, 2, 64


@pytest.fixture
def kvq(address):  # noqa: F811
    with KvqClient(address, namespace="layer-append") as c:
        yield c


def kv(tokens, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((LAYERS, HEADS, tokens, DIM)).astype(np.float16),
            rng.standard_normal((LAYERS, HEADS, tokens, DIM)).astype(np.float16))


def test_layers_added_one_by_one_commit_as_one_append(kvq):
    kvq.create_sequence(ModelLayout(LAYERS, HEADS, HEADS, DIM), scheme="fp16",
                        sequence_id="la1")
    k, v = kv(70, 0)
    first = LayerAppend(kvq, "la1", max_chunk_bytes=4096)  # Several messages per layer.
    for layer in range(LAYERS):
        first.add_layer(layer, k[layer, :, :40], v[layer, :, :40])
    assert first.finish() == 40
    assert first.wire_bytes == LAYERS * 2 * HEADS * 40 * DIM * 2
    second = LayerAppend(kvq, "la1")
    for layer in reversed(range(LAYERS)):  # Any layer order.
        second.add_layer(layer, k[layer, :, 40:], v[layer, :, 40:])
    assert second.finish() == 70
    K, V = kvq.fetch("la1")
    np.testing.assert_array_equal(K, k)
    np.testing.assert_array_equal(V, v)


def test_cancelled_or_failed_stream_stores_nothing(kvq):
    kvq.create_sequence(ModelLayout(LAYERS, HEADS, HEADS, DIM), scheme="fp16",
                        sequence_id="la2")
    k, v = kv(16, 1)
    cancelled = LayerAppend(kvq, "la2")
    cancelled.add_layer(0, k[0], v[0])
    cancelled.cancel()
    with pytest.raises(KvqError) as e:
        cancelled.finish()
    assert e.value.code == grpc.StatusCode.CANCELLED
    bad = LayerAppend(kvq, "la2")
    bad.add_layer(0, k[0], v[0])
    bad.add_layer(LAYERS, k[1], v[1])  # No such layer.
    with pytest.raises(KvqError) as e:
        bad.finish()
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    assert e.value.details == f"layers [{LAYERS}, {LAYERS + 1}) are not inside [0, {LAYERS})"
    assert kvq.stats("la2").num_tokens == 0
    with pytest.raises(KvqError) as e:
        bad.add_layer(0, k[0], v[0])
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_rejects_mismatched_shapes(kvq):
    stream = LayerAppend(kvq, "never-created")
    with pytest.raises(ValueError, match=r"k \(2, 4, 64\) and v \(2, 5, 64\) must both be"):
        stream.add_layer(0, np.zeros((2, 4, 64), np.float16), np.zeros((2, 5, 64), np.float16))
    with pytest.raises(KvqError) as e:
        stream.finish()  # Names the sequence even with no layer added.
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert e.value.details == 'sequence "never-created" in namespace "layer-append" does not exist'


@pytest.mark.parametrize("scheme", ["kivi4:g32:r128:sink=4", "int8"])
def test_layers_quantized_here_store_what_the_server_would(kvq, scheme):
    # The same layers, dense (quantized by the server) and as raw pages
    # quantized here, in two streams each, the second off a block boundary.
    layout = ModelLayout(LAYERS, HEADS, HEADS, DIM)
    by_server = kvq.create_sequence(layout, scheme=scheme).sequence_id
    by_client = kvq.create_sequence(layout, scheme=scheme).sequence_id
    k, v = kv(150 + 300, 3)
    for part in (slice(0, 150), slice(150, 450)):
        dense = LayerAppend(kvq, by_server)
        quantized = LayerAppend(kvq, by_client, scheme=scheme, start_tokens=part.start,
                                head_dim=DIM)
        for layer in range(LAYERS):
            dense.add_layer(layer, k[layer, :, part], v[layer, :, part])
            quantized.add_layer(layer, k[layer, :, part], v[layer, :, part])
        assert dense.finish() == quantized.finish() == part.stop
        assert quantized.wire_bytes < dense.wire_bytes
    assert kvq.stats(by_client).bytes == kvq.stats(by_server).bytes
    for a, b in zip(kvq.fetch(by_client, dtype="fp32"), kvq.fetch(by_server, dtype="fp32")):
        np.testing.assert_array_equal(a, b)
    sink = 4 if "sink" in scheme else 0
    end = 4 + 384 if sink else 450
    assert ([(l, t, p.SerializeToString()) for l, t, p in
             kvq.fetch_pages(by_client, token_begin=sink, token_end=end)] ==
            [(l, t, p.SerializeToString()) for l, t, p in
             kvq.fetch_pages(by_server, token_begin=sink, token_end=end)])
