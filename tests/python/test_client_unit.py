"""Unit tests of the Python client that need no kvq server: tensor
conversions (bit-exact fp16/bf16), chunk planning, fetch assembly, and the
client's retry/streaming behaviour against an in-process fake servicer."""

import os
from concurrent import futures

import grpc
import numpy as np
import pytest

import kvq_client
from kvq_client import (AttendQuery, DecodeItem, KvqClient, KvqError, ModelLayout, RetryPolicy,
                        bf16_bits_to_float32, float32_to_bf16_bits, from_tensor, plan_chunks,
                        to_tensor)
from kvq_client import _proto
from kvq_client.tensors import assemble_fetch

pb, pb_grpc = _proto.modules()

ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


# ------------------------------------------------------------- conversions

def test_every_bf16_value_round_trips_bit_exactly():
    f = bf16_bits_to_float32(ALL16)
    assert (f.view(np.uint32) == ALL16.astype(np.uint32) << 16).all()
    back = float32_to_bf16_bits(f)
    nan = ((ALL16 & 0x7F80) == 0x7F80) & ((ALL16 & 0x7F) != 0)
    assert (back[~nan] == ALL16[~nan]).all()
    assert np.isnan(bf16_bits_to_float32(back[nan])).all()


def test_bf16_rounds_to_nearest_even():
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, -2.0, 3.3895314e38, np.inf], np.float32)
    assert float32_to_bf16_bits(x).tolist() == [0x3F80, 0x3F82, 0xC000, 0x7F7F, 0x7F80]


def test_every_fp16_value_round_trips_through_the_wire():
    h = ALL16.view(np.float16).reshape(256, 256)
    t = to_tensor(h)
    assert t.dtype == pb.DTYPE_FP16 and list(t.shape) == [256, 256]
    assert t.data == h.tobytes()
    back = from_tensor(to_tensor(from_tensor(t).astype(np.float32), "fp16"))
    nan = np.isnan(h)
    assert (back.view(np.uint16)[~nan] == h.view(np.uint16)[~nan]).all()
    assert np.isnan(back[nan]).all()


def test_fp16_conversion_rounds_to_nearest_even_and_overflows_to_inf():
    x = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 65520.0, 65519.0, 2.0**-24], np.float32)
    bits = from_tensor(to_tensor(x, "fp16")).view(np.uint16)
    assert bits.tolist() == [0x3C00, 0x3C02, 0x7C00, 0x7BFF, 0x0001]


@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4), (2, 3, 4, 5)])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_tensor_round_trip_keeps_shape_and_values(shape, dtype):
    a = (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) - 3.0) * 0.25
    t = to_tensor(a, dtype)
    assert list(t.shape) == list(shape)
    assert len(t.data) == a.size * (4 if dtype == "fp32" else 2)
    b = from_tensor(t)
    assert b.shape == shape
    assert (b.astype(np.float32) == a).all()  # Quarters are exact in every dtype.
    assert b.dtype == (np.float16 if dtype == "fp16" else np.float32)


def test_from_tensor_rejects_malformed_tensors():
    with pytest.raises(ValueError, match=r"q\.dtype"):
        from_tensor(pb.Tensor(shape=[2], data=b"\0" * 8), "q")
    with pytest.raises(ValueError, match="needs 4 bytes, has 8"):
        from_tensor(pb.Tensor(dtype=pb.DTYPE_FP16, shape=[2], data=b"\0" * 8))
    with pytest.raises(ValueError):
        to_tensor(np.arange(4, dtype=np.int32))


# ---------------------------------------------------------------- chunking

def covered(chunks, layers, tokens):
    next_token = [0] * layers
    for l0, n, t0, t in chunks:
        assert n > 0 and t > 0
        for l in range(l0, l0 + n):
            assert next_token[l] == t0, f"layer {l} out of order"
            next_token[l] += t
    return next_token == [tokens] * layers


def test_large_prompt_splits_along_tokens():
    token_bytes = 2 * 8 * 128 * 2  # K+V fp16, 8 kv heads, head_dim 128.
    chunks = plan_chunks(32, 4096, token_bytes, 1 << 20)
    assert len(chunks) == 32 * 16
    assert all(n == 1 and t == 256 for _, n, _, t in chunks)
    assert covered(chunks, 32, 4096)


def test_small_layers_are_grouped():
    chunks = plan_chunks(32, 100, 1024, 1 << 20)
    assert [n for _, n, _, _ in chunks] == [10, 10, 10, 2]
    assert covered(chunks, 32, 100)


@pytest.mark.parametrize("layers", [1, 3, 7])
@pytest.mark.parametrize("tokens", [1, 5, 129, 1000])
@pytest.mark.parametrize("max_bytes", [1, 100, 4096, 1 << 20])
def test_chunks_cover_exactly_within_the_limit(layers, tokens, max_bytes):
    chunks = plan_chunks(layers, tokens, 40, max_bytes)
    assert covered(chunks, layers, tokens)
    for _, n, _, t in chunks:
        assert n * t * 40 <= max_bytes or (n == 1 and t == 1)


def test_assemble_fetch_joins_pieces_and_rejects_gaps():
    k = np.arange(2 * 2 * 10 * 4, dtype=np.float32).reshape(2, 2, 10, 4)
    pieces = [(5 + l, t, k[l][:, t:t + 3], -k[l][:, t:t + 3]) for l in (1, 0) for t in (9, 6, 3, 0)]
    pieces = [(l, t, a[:, : min(3, 10 - t)], b[:, : min(3, 10 - t)]) for l, t, a, b in pieces]
    layer, token, K, V = assemble_fetch(pieces)
    assert (layer, token) == (5, 0)
    assert (K == k).all() and (V == -k).all()
    with pytest.raises(ValueError, match="gap or overlap"):
        assemble_fetch([p for p in pieces if p[1] != 3])
    with pytest.raises(ValueError, match="not contiguous"):
        assemble_fetch([p for p in pieces if p[0] == 5] + [(7,) + p[1:] for p in pieces if p[0] == 6])


def test_backoff_grows_exponentially_to_the_cap():
    p = RetryPolicy(initial_backoff=0.05, multiplier=2.0, max_backoff=0.3)
    assert [p.backoff(i) for i in (1, 2, 3, 4, 10)] == [0.05, 0.1, 0.2, 0.3, 0.3]


# ----------------------------------------------------- client vs a fake

class FakeKvCache(pb_grpc.KvCacheServicer):
    """Counts calls; fails the next calls of a method on request; stores
    appended chunks; echoes q as attention output and the layer as lse."""

    def __init__(self):
        self.calls = {}
        self.failures = {}
        self.released = set()
        self.chunks = []
        self.first_request = None
        self.state_range = False  # FetchDequant: range fields on the first message, as kvq-server.

    def _enter(self, method, context):
        self.calls[method] = self.calls.get(method, 0) + 1
        n, code = self.failures.get(method, (0, None))
        if n > 0:
            self.failures[method] = (n - 1, code)
            context.abort(code, f"injected {code.name}")

    def GetServerInfo(self, request, context):
        self._enter("GetServerInfo", context)
        return pb.ServerInfo(version="fake")

    def Append(self, request_iterator, context):
        self._enter("Append", context)
        tokens = 0
        for i, r in enumerate(request_iterator):
            if i == 0:
                self.first_request = r
            self.chunks.append(r.chunk)
            if r.chunk.layer_begin == 0:
                tokens += r.chunk.k.shape[2]
        return pb.AppendResponse(num_tokens=tokens)

    def FetchDequant(self, request, context):
        self._enter("FetchDequant", context)
        for layer in range(2):
            for t in range(0, 10, 4):
                n = min(4, 10 - t)
                k = np.full((2, n, 8), layer * 100 + t, np.float16)
                m = pb.FetchResponse(layer=layer, token_begin=t, k=to_tensor(k), v=to_tensor(-k))
                if self.state_range and layer == 0 and t == 0:
                    m.range_layer_end, m.range_token_end = 2, 10
                yield m

    def _echo(self, layer, q):
        qa = from_tensor(q)
        return pb.AttendResult(out=to_tensor(qa.astype(np.float32)),
                               lse=to_tensor(np.full(qa.shape[:2], layer, np.float32)))

    def Attend(self, request, context):
        self._enter("Attend", context)
        return pb.AttendResponse(results=[self._echo(request.layer, i.q) for i in request.items])

    def AppendAttend(self, request, context):
        self._enter("AppendAttend", context)
        return pb.AttendResponse(results=[self._echo(request.layer, i.q) for i in request.items])

    def DecodeStream(self, request_iterator, context):
        self._enter("DecodeStream", context)
        for r in request_iterator:
            if r.step.layer < 0:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "negative layer")
            yield pb.DecodeResponse(result=pb.AttendResponse(
                results=[self._echo(r.step.layer, i.q) for i in r.step.items]))

    def Release(self, request, context):
        self._enter("Release", context)
        key = (request.sequence.namespace, request.sequence.sequence_id)
        if key in self.released:
            context.abort(grpc.StatusCode.NOT_FOUND, "already released")
        self.released.add(key)
        if self.failures.pop("ReleaseReply", None):
            context.abort(grpc.StatusCode.UNAVAILABLE, "reply lost")
        return pb.ReleaseResponse(bytes_freed=4096)


@pytest.fixture
def fake():
    servicer = FakeKvCache()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_KvCacheServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = KvqClient(f"127.0.0.1:{port}", namespace="tenant",
                       retry=RetryPolicy(initial_backoff=0.001, max_backoff=0.004))
    yield servicer, client
    client.close()
    server.stop(None)


def test_idempotent_calls_are_retried(fake):
    servicer, client = fake
    servicer.failures["GetServerInfo"] = (2, grpc.StatusCode.UNAVAILABLE)
    assert client.info().version == "fake"
    assert servicer.calls["GetServerInfo"] == 3


def test_retries_stop_after_max_attempts_and_keep_code(fake):
    servicer, client = fake
    servicer.failures["GetServerInfo"] = (100, grpc.StatusCode.UNAVAILABLE)
    with pytest.raises(KvqError) as e:
        client.info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls["GetServerInfo"] == client.retry.max_attempts


def test_state_changing_calls_are_not_retried(fake):
    servicer, client = fake
    servicer.failures["AppendAttend"] = (1, grpc.StatusCode.UNAVAILABLE)
    item = DecodeItem("s", np.zeros((2, 1, 8), np.float16), np.zeros((2, 1, 8), np.float16),
                      np.zeros((1, 4, 8), np.float32))
    with pytest.raises(KvqError) as e:
        client.append_attend(0, [item])
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.calls["AppendAttend"] == 1


def test_other_errors_are_not_retried(fake):
    servicer, client = fake
    servicer.failures["Attend"] = (1, grpc.StatusCode.NOT_FOUND)
    with pytest.raises(KvqError) as e:
        client.attend(0, [AttendQuery("x", np.zeros((1, 4, 8), np.float32))])
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert e.value.details == "injected NOT_FOUND"
    assert servicer.calls["Attend"] == 1


def test_release_whose_reply_was_lost_succeeds_on_retry(fake):
    servicer, client = fake
    servicer.failures["ReleaseReply"] = True
    assert client.release("s") == 0
    assert servicer.calls["Release"] == 2
    with pytest.raises(KvqError) as e:  # Without a retry NOT_FOUND stays an error.
        client.release("s")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_append_prompt_streams_chunks_that_cover_the_prompt(fake):
    servicer, client = fake
    rng = np.random.default_rng(1)
    k = rng.standard_normal((3, 2, 50, 8)).astype(np.float32)
    v = rng.standard_normal((3, 2, 50, 8)).astype(np.float32)
    seen = []
    r = client.append_prompt("s", k, v, layer_begin=4, max_chunk_bytes=20 * 2 * 2 * 8 * 2,
                             wire_dtype="fp16", token_ids=list(range(50)),
                             progress=lambda done, total: seen.append((done, total)))
    assert r.chunks == 3 * 3 and len(servicer.chunks) == 9  # 20 + 20 + 10 tokens per layer.
    assert servicer.first_request.sequence.namespace == "tenant"
    assert list(servicer.first_request.token_ids) == list(range(50))
    assert seen[-1][0] == seen[-1][1] == 3 * 50 * 2 * 2 * 8 * 2
    got_k = np.zeros_like(k, dtype=np.float16)
    offset = {}
    for c in servicer.chunks:  # In stream order: each layer's tokens in order.
        part = from_tensor(c.k)
        assert part.dtype == np.float16
        for i in range(part.shape[0]):
            layer = c.layer_begin - 4 + i
            t0 = offset.get(layer, 0)
            got_k[layer, :, t0:t0 + part.shape[2]] = part[i]
            offset[layer] = t0 + part.shape[2]
    assert offset == {0: 50, 1: 50, 2: 50}
    assert (got_k == k.astype(np.float16)).all()


def test_fetch_assembles_the_stream(fake):
    servicer, client = fake
    servicer.failures["FetchDequant"] = (1, grpc.StatusCode.UNAVAILABLE)
    K, V = client.fetch("s")
    assert K.shape == (2, 2, 10, 8) and K.dtype == np.float16
    assert K[1, 0, 5, 0] == 104 and (V == -K).all()
    assert servicer.calls["FetchDequant"] == 2


def test_fetch_with_a_stated_range_fills_arrays_in_place(fake):
    servicer, client = fake
    servicer.state_range = True
    servicer.failures["FetchDequant"] = (1, grpc.StatusCode.UNAVAILABLE)
    totals = []
    K, V = client.fetch("s", progress=lambda done, total: totals.append(total))
    assert K.shape == (2, 2, 10, 8) and K.dtype == np.float16
    assert K[1, 0, 5, 0] == 104 and K[0, 1, 9, 7] == 8 and (V == -K).all()
    assert set(totals) == {2 * K.nbytes}  # Known from the first message on.
    assert servicer.calls["FetchDequant"] == 2


CHECKOUT_PROTO_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "proto")


def test_installed_modules_are_from_the_checkouts_proto():
    # The package installed for the tests was built from this kvq.proto
    # (not an older one: reinstall with `pip install .` after changing it).
    stamp = os.path.join(_proto.GEN_DIR, _proto._STAMP)
    with open(stamp) as f:
        assert f.read().strip() == _proto._proto_hash(
            os.path.join(CHECKOUT_PROTO_DIR, "kvq", "v1", "kvq.proto"))


def test_generated_modules_follow_the_proto(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_PROTO_DIR", CHECKOUT_PROTO_DIR)
    monkeypatch.setattr(_proto, "_PACKAGE_DIR", str(tmp_path))
    monkeypatch.setattr(_proto, "GEN_DIR", str(tmp_path / "_gen"))
    proto = os.path.join(_proto.proto_root(), "kvq", "v1", "kvq.proto")
    assert not _proto._up_to_date(proto)
    _proto.generate()
    stamp = tmp_path / "_gen" / _proto._STAMP
    assert _proto._up_to_date(proto) and stamp.read_text().strip() == _proto._proto_hash(proto)
    stamp.write_text("made from an older kvq.proto\n")
    assert not _proto._up_to_date(proto)
    _proto.generate()  # Regenerates: the stamp matches again.
    assert _proto._up_to_date(proto)
    assert (tmp_path / "_gen" / "kvq" / "v1" / "kvq_pb2.py").is_file()


def test_decode_session_steps_in_order_and_surfaces_the_stream_error(fake):
    _, client = fake
    item = DecodeItem("s", np.zeros((2, 1, 8), np.float16), np.zeros((2, 1, 8), np.float16),
                      np.ones((1, 4, 8), np.float32))
    with client.decode_session() as session:
        for layer in range(3):
            [(out, lse)] = session.step(layer, [item])
            assert (lse == layer).all() and (out == 1).all()
        session.write(0, [item])
        session.write(1, [item])  # Two in flight, read back in order.
        assert session.read()[0][1][0, 0] == 0
        assert session.read()[0][1][0, 0] == 1
    session = client.decode_session()
    session.write(-1, [item])
    with pytest.raises(KvqError) as e:
        session.read()
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_decode_session_block_closes_when_clean_and_cancels_when_it_raises(fake):
    _, client = fake
    item = DecodeItem("s", np.zeros((2, 1, 8), np.float16), np.zeros((2, 1, 8), np.float16),
                      np.ones((1, 4, 8), np.float32))
    with pytest.raises(KvqError) as e:  # close() drains the stream and raises its error.
        with client.decode_session() as session:
            session.write(-1, [item])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # cancel(): the block's own exception is the one that comes out.
    with pytest.raises(RuntimeError, match="^the block's own error$"):
        with client.decode_session() as session:
            session.write(-1, [item])
            raise RuntimeError("the block's own error")


def test_model_layout_goes_to_the_wire():
    m = ModelLayout(4, 2, 8, 64, kvq_client.RopeParams(theta=5e5, pairing="adjacent", scaling="ntk",
                                                       factor=4.0)).to_proto()
    assert (m.num_layers, m.num_kv_heads, m.num_q_heads, m.head_dim) == (4, 2, 8, 64)
    assert m.rope.pairing == pb.RopeParams.PAIRING_ADJACENT
    assert m.rope.scaling == pb.RopeParams.SCALING_NTK
    assert m.rope.factor == 4.0
