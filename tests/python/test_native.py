"""kvq._native (the KvLayer of kvq's kernels in Python) against numpy
references: quantization within each scheme's error bound, fp16 exact,
fused attention against attention over the dequantized K/V, raw pages byte
for byte, and C++ errors as Python exceptions with the C++ message.

Needs the installed package (`pip install .`): the native module is built,
not importable from the source tree."""

import numpy as np
import pytest

import kvq

HEADS, DIM = 2, 64


def rand(shape, seed, dtype=np.float16):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def kivi_bound(x, bits, group, axis):
    """Elementwise bound of a kivi round trip of x [heads, tokens, dim]: half
    a quantization step of each group (G tokens of a channel for keys, G
    channels of a token for values) plus the fp16 rounding of the group's
    scale and zero point."""
    h, n, d = x.shape
    if axis == "tokens":
        g = x.reshape(h, n // group, group, d)
        lo, hi = g.min(axis=2, keepdims=True), g.max(axis=2, keepdims=True)
    else:
        g = x.reshape(h, n, d // group, group)
        lo, hi = g.min(axis=3, keepdims=True), g.max(axis=3, keepdims=True)
    step = (hi - lo) / (2 ** bits - 1)
    bound = 0.5 * step + 2.0 ** -10 * (np.abs(lo) + (hi - lo)) + 1e-6
    return np.broadcast_to(bound, g.shape).reshape(h, n, d)


@pytest.mark.parametrize("bits", [4, 2])
def test_kivi_round_trip_within_the_scheme_bound(bits):
    layer = kvq.KvLayer(f"kivi{bits}:g32:r128:sink=4", HEADS, DIM)
    assert layer.scheme == f"kivi{bits}:g32:r128:sink=4"
    n = 4 + 256 + 40  # Sink, two flushed blocks, a partial fp16 tail.
    k, v = rand((HEADS, n, DIM), 1), rand((HEADS, n, DIM), 2)
    layer.append(k, v)
    assert (layer.num_tokens, layer.sink_tokens, layer.quantized_tokens,
            layer.tail_tokens) == (n, 4, 256, 40)
    K, V = layer.read()
    assert K.dtype == np.float32 and K.shape == (HEADS, n, DIM)
    kf, vf = k.astype(np.float32), v.astype(np.float32)
    # Sink and tail are fp16: exactly the input.
    for a, b in ((K, kf), (V, vf)):
        assert (a[:, :4] == b[:, :4]).all() and (a[:, 260:] == b[:, 260:]).all()
    q = slice(4, 260)
    kb = kivi_bound(kf[:, q], bits, 32, "tokens")
    vb = kivi_bound(vf[:, q], bits, 32, "channels")
    assert (np.abs(K[:, q] - kf[:, q]) <= kb).all()
    assert (np.abs(V[:, q] - vf[:, q]) <= vb).all()
    # And it is really quantized: not the input.
    assert np.abs(K[:, q] - kf[:, q]).max() > 0
    # A sub-range reads the same values; out arrays are written in place.
    out_k = np.empty((HEADS, 100, DIM), np.float32)
    out_v = np.empty_like(out_k)
    rk, rv = layer.read(50, 150, out_k=out_k, out_v=out_v)
    assert rk is out_k and rv is out_v
    assert (out_k == K[:, 50:150]).all() and (out_v == V[:, 50:150]).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fp16_scheme_is_exact(dtype):
    layer = kvq.KvLayer("fp16", HEADS, DIM)
    k, v = rand((HEADS, 70, DIM), 3), rand((HEADS, 70, DIM), 4)
    layer.append(k.astype(dtype), v.astype(dtype))
    K, V = layer.read()
    assert (K == k.astype(np.float32)).all() and (V == v.astype(np.float32)).all()


def test_strided_input_is_read_in_place():
    # [tokens, heads, dim] memory seen as [heads, tokens, dim]: strided
    # heads and rows, contiguous head_dim.
    base = rand((50, HEADS, DIM), 5)
    k = base.transpose(1, 0, 2)
    assert not k.flags.c_contiguous
    layer = kvq.KvLayer("fp16", HEADS, DIM)
    layer.append(k, k)
    K, _ = layer.read()
    assert (K == k.astype(np.float32)).all()


def test_torch_tensors_without_copy():
    torch = pytest.importorskip("torch")
    layer = kvq.KvLayer("bf16", HEADS, DIM)
    k = torch.randn(HEADS, 40, DIM, dtype=torch.bfloat16)
    v = torch.randn(40, HEADS, DIM, dtype=torch.bfloat16).permute(1, 0, 2)  # Strided view.
    layer.append(k, v)
    K, V = layer.read()
    assert (K == k.float().numpy()).all() and (V == v.float().numpy()).all()
    out_k = torch.empty(HEADS, 40, DIM)
    out_v = torch.empty(HEADS, 40, DIM)
    rk, _ = layer.read(out_k=out_k, out_v=out_v)
    assert rk is out_k and torch.equal(out_k, k.float())


def reference_attention(q, K, V, positions, scale):
    hq, n_q, d = q.shape
    group = hq // K.shape[0]
    out = np.empty_like(q)
    lse = np.empty((hq, n_q), np.float32)
    for h in range(hq):
        s = (q[h].astype(np.float64) @ K[h // group].T.astype(np.float64)) * scale
        for i, p in enumerate(positions):
            s[i, p + 1:] = -np.inf
        m = s.max(axis=1, keepdims=True)
        w = np.exp(s - m)
        z = w.sum(axis=1, keepdims=True)
        out[h] = (w / z) @ V[h // group]
        lse[h] = (m + np.log(z))[:, 0]
    return out, lse


@pytest.mark.parametrize("scheme", ["fp16", "kivi4:g32:r128", "int8"])
def test_attend_matches_attention_over_the_dequantized_kv(scheme):
    layer = kvq.KvLayer(scheme, HEADS, DIM)
    n = 300
    layer.append(rand((HEADS, n, DIM), 6), rand((HEADS, n, DIM), 7))
    K, V = layer.read()
    q = rand((4 * HEADS, 5, DIM), 8, np.float32)  # GQA 4, five causal queries.
    out, lse = layer.attend(q, return_lse=True)
    ref_out, ref_lse = reference_attention(q, K, V, range(n - 5, n), DIM ** -0.5)
    assert out.shape == q.shape and lse.shape == (4 * HEADS, 5)
    np.testing.assert_allclose(out, ref_out, atol=2e-4, rtol=1e-3)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-4, rtol=1e-4)
    # Explicit positions and scale.
    pos = [10, 100, 299, 0, 5]
    out2 = layer.attend(q, positions=pos, scale=0.05)
    ref2, _ = reference_attention(q, K, V, pos, 0.05)
    np.testing.assert_allclose(out2, ref2, atol=2e-4, rtol=1e-3)


def test_pre_rope_needs_theta_and_applies_rope_on_read():
    with pytest.raises(ValueError, match="has pre_rope: kvq applies RoPE, so give rope_theta"):
        kvq.KvLayer("kivi4:pre_rope", HEADS, DIM)
    layer = kvq.KvLayer("kivi4:pre_rope", HEADS, DIM, rope_theta=10000.0)
    k = rand((HEADS, 8, DIM), 9)
    layer.append(k, k)
    K, V = layer.read()  # Keys come back post-RoPE: position 0 unrotated.
    assert (K[:, 0] == k[:, 0].astype(np.float32)).all()
    assert not np.allclose(K[:, 5], k[:, 5].astype(np.float32), atol=1e-2)
    assert (V == k.astype(np.float32)).all()


@pytest.mark.parametrize("scheme", ["kivi4:g32:r128", "kivi2:g32:r128:sink=4", "int8", "bf16",
                                    "kivi2:g32:r64:p8:outliers=1"])
def test_pages_round_trip_byte_exact(scheme):
    a = kvq.KvLayer(scheme, HEADS, DIM)
    sink = kvq.page_geometry(scheme, DIM)["sink"]
    n = sink + 256
    k, v = rand((HEADS, n, DIM), 10), rand((HEADS, n, DIM), 11)
    a.append(k, v)
    assert a.quantized_tokens == 256 and a.tail_tokens == 0 and a.accepts_pages
    pages = a.pages()
    assert len(pages) == HEADS * -(-256 // a.page_tokens) * a.page_bytes
    # What a client sends for the same tokens is the same bytes.
    assert kvq.quantize_pages(scheme, k[:, sink:], v[:, sink:]) == pages
    # A second layer fed the pages stores and reads them identically.
    b = kvq.KvLayer(scheme, HEADS, DIM)
    b.append(k[:, :sink], v[:, :sink])
    b.append_pages(memoryview(pages), 256)
    assert b.num_tokens == n and b.pages() == pages
    for x, y in zip(a.read(), b.read()):
        assert (x == y).all()
    assert b.bytes_by_component() == a.bytes_by_component()


def test_quantize_pages_of_layers_is_layer_major():
    k, v = rand((3, HEADS, 128, DIM), 12), rand((3, HEADS, 128, DIM), 13)
    whole = kvq.quantize_pages("kivi4", k, v)
    assert whole == b"".join(kvq.quantize_pages("kivi4", k[i], v[i]) for i in range(3))


def test_bytes_by_component():
    layer = kvq.KvLayer("kivi4:g32:r128", HEADS, DIM)
    layer.append(rand((HEADS, 256 + 10, DIM), 14), rand((HEADS, 256 + 10, DIM), 15))
    b = layer.bytes_by_component()
    assert b["codes"] == 2 * HEADS * 256 * DIM * 4 // 8  # K and V, 4 bits.
    assert b["scales"] > 0 and b["residual"] > 0 and b["outliers"] == 0
    assert b["total"] == sum(b[c] for c in ("codes", "scales", "outliers", "residual", "sink",
                                            "codebook", "padding"))


def test_errors_carry_the_cpp_message():
    with pytest.raises(ValueError, match='scheme "kivi9"'):
        kvq.KvLayer("kivi9", HEADS, DIM)
    layer = kvq.KvLayer("kivi4", HEADS, DIM)
    with pytest.raises(ValueError, match=r"k is \[3, 10, 64\]; the layer has 2 kv heads"):
        layer.append(rand((3, 10, DIM), 0), rand((3, 10, DIM), 0))
    bad = rand((HEADS, 10, DIM), 0, np.float32)
    bad[1, 3, 7] = np.nan
    with pytest.raises(ValueError, match="kv head 1: "):
        layer.append(bad, bad)
    assert layer.num_tokens == 0  # Nothing of a failed append is stored.
    layer.append(rand((HEADS, 10, DIM), 0), rand((HEADS, 10, DIM), 0))
    # Raw pages need an empty fp16 tail: FAILED_PRECONDITION -> RuntimeError.
    with pytest.raises(RuntimeError, match="kv head 0: raw pages append at a page boundary"):
        layer.append_pages(b"\0" * (HEADS * layer.page_bytes), 32)
    assert layer.num_tokens == 10
    with pytest.raises(ValueError, match="data has 5 bytes"):
        layer.append_pages(b"12345", 128)
    with pytest.raises(ValueError, match=r"read range \[0, 11\) is not inside \[0, 10\]"):
        layer.read(0, 11)
    with pytest.raises(ValueError, match="not a positive multiple of num_kv_heads 2"):
        layer.attend(rand((3, 1, DIM), 0, np.float32))
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        layer.append(np.zeros((HEADS, 1, DIM), np.int32), np.zeros((HEADS, 1, DIM), np.int32))
    with pytest.raises(RuntimeError, match="fp8_e4m3 streams do not take raw pages"):
        kvq.quantize_pages("fp8_e4m3", rand((HEADS, 8, DIM), 0), rand((HEADS, 8, DIM), 0))
    with pytest.raises(ValueError, match="raw pages hold whole blocks of 128 tokens"):
        kvq.quantize_pages("kivi4", rand((HEADS, 100, DIM), 0), rand((HEADS, 100, DIM), 0))


def test_corrupt_pages_are_rejected_and_nothing_is_stored():
    a = kvq.KvLayer("kivi4", HEADS, DIM)
    a.append(rand((HEADS, 128, DIM), 16), rand((HEADS, 128, DIM), 17))
    pages = bytearray(a.pages())
    # The first fp16 scale of head 1's key side set to NaN.
    geometry_page = len(pages) // HEADS
    b = kvq.KvLayer("kivi4", HEADS, DIM)
    good = bytes(pages)
    b.append_pages(good[:geometry_page * HEADS], 128)
    c = kvq.KvLayer("kivi4", HEADS, DIM)
    pages[geometry_page:] = b"\xff" * (len(pages) - geometry_page)  # Head 1: all NaN.
    with pytest.raises(ValueError, match="kv head 1: "):
        c.append_pages(bytes(pages), 128)
    assert c.num_tokens == 0 and c.bytes_by_component()["codes"] == 0


def uniform_codebooks(bits, heads):
    levels = np.tile(np.arange(2 ** bits) / (2 ** bits - 1), (DIM, 1)).astype(np.float32)
    return [(levels.ravel().tolist(), levels.ravel().tolist())] * heads


def test_nuq_takes_codebooks_per_head():
    with pytest.raises(ValueError, match="has nuq: it needs 2 codebooks"):
        kvq.KvLayer("kivi4:nuq", HEADS, DIM)
    nuq = kvq.KvLayer("kivi4:nuq", HEADS, DIM, codebooks=uniform_codebooks(4, HEADS))
    plain = kvq.KvLayer("kivi4", HEADS, DIM)
    k = rand((HEADS, 256, DIM), 18)
    nuq.append(k, k)
    plain.append(k, k)
    assert nuq.bytes_by_component()["codebook"] == HEADS * 2 * DIM * 16 * 2  # fp16 levels.
    # Uniform levels quantize as well as plain kivi (not bit for bit: the
    # levels are fp16 and the rounding is to the nearest level).
    kf = k.astype(np.float32)
    e_nuq = np.abs(nuq.read()[0] - kf).mean()
    e_plain = np.abs(plain.read()[0] - kf).mean()
    assert abs(e_nuq - e_plain) < 0.02 * e_plain
    pages = nuq.pages()
    assert kvq.quantize_pages("kivi4:nuq", k, k, codebooks=uniform_codebooks(4, HEADS)) == pages


def test_kvq_client_is_the_grpc_client():
    import kvq.client
    import kvq_client
    assert kvq.client.KvqClient is kvq_client.KvqClient
    assert set(kvq.client.__all__) == set(kvq_client.__all__)
