"""The Python client against the real kvq-server on a free loopback port.

Needs the server binary: $KVQ_SERVER_BIN (ctest sets it), else the test is
skipped."""

import numpy as np
import pytest

from kvq_client import AttendQuery, DecodeItem, KvqError, ModelLayout, RopeParams
from live_server import CPU_SERVER, client_fixture, needs_server, server_fixture

pytestmark = needs_server

LAYERS, HEADS, QHEADS, DIM = 2, 2, 4, 64


address = server_fixture(*CPU_SERVER)
client = client_fixture("py")


def layout():
    return ModelLayout(LAYERS, HEADS, QHEADS, DIM, RopeParams(theta=500000.0))


def test_prefill_fetch_attend_stats_release(client):
    info = client.info()
    assert "kivi2" in list(info.schemes)
    seq = client.create_sequence(layout(), scheme="kivi2:sink=4", sequence_id="p1")
    assert seq.scheme == "kivi2:g32:r128:sink=4" and seq.block_tokens == 128

    rng = np.random.default_rng(0)
    k = rng.standard_normal((LAYERS, HEADS, 600, DIM)).astype(np.float32)
    v = rng.standard_normal((LAYERS, HEADS, 600, DIM)).astype(np.float16)
    progress = []
    r = client.append_prompt("p1", k, v, max_chunk_bytes=64 << 10,
                             progress=lambda d, t: progress.append((d, t)))
    assert r.num_tokens == 600 and r.chunks > LAYERS
    assert progress[-1][0] == progress[-1][1]

    K, V = client.fetch("p1", dtype="fp32", max_chunk_bytes=32 << 10)
    assert K.shape == (LAYERS, HEADS, 600, DIM) and K.dtype == np.float32
    # Sink (4) and the fp16 tail (600 - 4 - 512 = 84 tokens) come back as
    # fp16 of the input; the rest is 2-bit quantized.
    assert (K[:, :, :4] == k[:, :, :4].astype(np.float16)).all()
    assert (V[:, :, 516:] == v[:, :, 516:]).all()
    err = np.abs(K - k).mean()
    assert 0.0 < err < 0.5
    K16, _ = client.fetch("p1", layer_begin=1, token_begin=100, token_end=200)
    assert K16.shape == (1, HEADS, 100, DIM) and K16.dtype == np.float16
    assert (K16.astype(np.float32) == K[1:, :, 100:200].astype(np.float16).astype(np.float32)).all()

    # Into the caller's arrays, reused: the same values, several messages per layer.
    Ko = np.full((LAYERS - 1, HEADS, 550, DIM), np.nan, dtype=np.float32)
    Vo = np.full_like(Ko, np.nan)
    for _ in range(2):
        got = client.fetch("p1", layer_begin=1, token_begin=50, dtype="fp32",
                           max_chunk_bytes=8 << 10, out=(Ko, Vo))
        assert got[0] is Ko and got[1] is Vo
        assert (Ko == K[1:, :, 50:600]).all() and (Vo == V[1:, :, 50:600]).all()
    with pytest.raises(ValueError, match="out V must be a writeable C-contiguous float32"):
        client.fetch("p1", dtype="fp32", out=(Ko, Vo.astype(np.float16)))
    with pytest.raises(ValueError, match=r"tokens \[0, 550\), but layer_end is 2 and token_end 100"):
        client.fetch("p1", layer_begin=1, layer_end=2, token_end=100, dtype="fp32", out=(Ko, Vo))

    q = rng.standard_normal((2, QHEADS, DIM)).astype(np.float32)
    [(out, lse)] = client.attend(1, [AttendQuery("p1", q, q_positions=[300, 599])])
    assert out.shape == (2, QHEADS, DIM) and lse.shape == (2, QHEADS)
    # Attention over the fetched cache (GQA: q heads 2h, 2h+1 share kv head h).
    for i, pos in enumerate([300, 599]):
        for h in range(QHEADS):
            keys, vals = K[1, h // 2, :pos + 1], V[1, h // 2, :pos + 1].astype(np.float32)
            s = keys @ q[i, h] / np.sqrt(DIM)
            m = s.max()
            w = np.exp(s - m)
            np.testing.assert_allclose(out[i, h], w @ vals / w.sum(), rtol=2e-3, atol=2e-3)
            np.testing.assert_allclose(lse[i, h], m + np.log(w.sum()), rtol=1e-4, atol=1e-3)

    # The packed form: one query per sequence, the same bytes as per item.
    client.create_sequence(layout(), scheme="fp16", sequence_id="p2")
    client.append_prompt("p2", k[:, :, :200], v[:, :, :200])
    qb = rng.standard_normal((2, QHEADS, DIM)).astype(np.float16)
    out_b, lse_b = client.attend_batch(1, ["p1", "p2"], qb)
    assert out_b.shape == (2, QHEADS, DIM) and lse_b.shape == (2, QHEADS)
    each = client.attend(1, [("p1", qb[:1]), ("p2", qb[1:])])
    assert (out_b == np.concatenate([o for o, _ in each])).all()
    assert (lse_b == np.concatenate([l for _, l in each])).all()
    out_k, lse_k = client.attend_batch(1, ["p1", "p2"], qb, key_end=100)
    each = client.attend(1, [AttendQuery("p1", qb[:1], key_end=100),
                             AttendQuery("p2", qb[1:], key_end=100)])
    assert (out_k == np.concatenate([o for o, _ in each])).all()
    assert not (out_k == out_b).all()
    with pytest.raises(ValueError, match=r"q must be \[2 sequences"):
        client.attend_batch(1, ["p1", "p2"], qb[:1])
    assert client.release("p2") > 0

    stats = client.stats("p1")
    assert stats.num_tokens == 600 and stats.scheme == seq.scheme
    assert client.stats().sequences >= 1
    assert client.release("p1") > 0
    with pytest.raises(KvqError) as e:
        client.release("p1")
    assert e.value.code.name == "NOT_FOUND"


def test_decode_session_append_attend_and_fork(client):
    client.create_sequence(layout(), scheme="kivi4", sequence_id="d1")
    rng = np.random.default_rng(1)
    k = rng.standard_normal((LAYERS, HEADS, 130, DIM)).astype(np.float16)
    client.append_prompt("d1", k, k)
    with client.decode_session() as session:
        for step in range(3):
            for layer in range(LAYERS):
                item = DecodeItem("d1", rng.standard_normal((HEADS, 1, DIM)).astype(np.float16),
                                  rng.standard_normal((HEADS, 1, DIM)).astype(np.float16),
                                  rng.standard_normal((1, QHEADS, DIM)).astype(np.float32))
                [(out, lse)] = session.step(layer, [item])
                assert out.shape == (1, QHEADS, DIM) and np.isfinite(lse).all()
    for layer in range(LAYERS):
        client.append_attend(layer, [("d1", k[layer, :, :1], k[layer, :, :1],
                                      rng.standard_normal((1, QHEADS, DIM)).astype(np.float32))])
    assert client.stats("d1").num_tokens == 134
    # The packed decode step: the same outputs as item by item on a copy.
    client.create_sequence(layout(), scheme="kivi4", sequence_id="d3")
    client.append_prompt("d3", k, k)
    client.create_sequence(layout(), scheme="kivi4", sequence_id="d4")
    client.append_prompt("d4", k, k)
    kb = rng.standard_normal((1, HEADS, DIM)).astype(np.float16)
    qb = rng.standard_normal((1, QHEADS, DIM)).astype(np.float32)
    [(out_e, lse_e)] = client.append_attend(0, [("d3", kb.reshape(HEADS, 1, DIM),
                                                 kb.reshape(HEADS, 1, DIM), qb)])
    out_p, lse_p = client.append_attend_batch(0, ["d4"], kb, kb, qb)
    assert (out_p == out_e).all() and (lse_p == lse_e).all()
    with client.decode_session() as session:
        out_s, _ = session.step_batch(1, ["d4"], kb, kb, qb)
        assert out_s.shape == (1, QHEADS, DIM)
    assert client.stats("d4").num_tokens == 131  # Both layers (LAYERS == 2) got their token.
    with pytest.raises(ValueError, match=r"q must be \[1 sequences"):
        client.append_attend_batch(0, ["d4"], kb, kb, qb[:0])
    child, n = client.fork("d1", new_sequence_id="d2", num_tokens=128)
    assert (child, n) == ("d2", 128)
    assert client.stats("d2").num_tokens == 128
    with pytest.raises(KvqError) as e:
        client.create_sequence(layout(), sequence_id="d1")
    assert e.value.code.name == "ALREADY_EXISTS"
    client.release("d2")
    client.release("d1")


def test_keys_and_values_at_different_bits(client):
    """vN: 4-bit keys and 2-bit values in one sequence; each side comes back
    with its own width's error."""
    seq = client.create_sequence(layout(), scheme="kivi4:v2:g32:r32", sequence_id="mix1")
    assert seq.scheme == "kivi4:v2:g32:r32"
    rng = np.random.default_rng(3)
    k = rng.standard_normal((LAYERS, HEADS, 256, DIM)).astype(np.float32)
    v = rng.standard_normal((LAYERS, HEADS, 256, DIM)).astype(np.float32)
    client.append_prompt("mix1", k, v)
    K, V = client.fetch("mix1", dtype="fp32")
    # Every token is quantized (256 = 8 flushes of 32): 15 levels against 3.
    k_err = np.abs(K - k).mean()
    v_err = np.abs(V - v).mean()
    assert 0.0 < k_err < 0.1 < v_err < 0.5, (k_err, v_err)  # Measured 0.065, 0.33.
    assert v_err > 3 * k_err
    assert client.release("mix1") > 0


def test_a_lease_above_the_maximum_is_capped_and_reported(client):
    # The server's defaults: --default_ttl_seconds=600, --max_ttl_seconds=86400.
    assert client.create_sequence(layout(), scheme="int8", sequence_id="lease-0").ttl_seconds == 600
    assert client.create_sequence(layout(), scheme="int8", sequence_id="lease-60",
                                  ttl_seconds=60).ttl_seconds == 60
    capped = client.create_sequence(layout(), scheme="int8", sequence_id="lease-long",
                                    ttl_seconds=10 ** 6)
    assert capped.ttl_seconds == 86400
