"""append_prompt's client-side quantization against the real kvq-server:
the pages the client makes are the bytes the server stores, and what
travels is what is stored.

Needs the server binary ($KVQ_SERVER_BIN, ctest sets it; skipped without)
and the installed package with its native module."""

import numpy as np
import pytest

import kvq
from kvq_client import ModelLayout, RopeParams
from live_server import CPU_SERVER, client_fixture, needs_server, server_fixture

pytestmark = needs_server

LAYERS, HEADS, QHEADS, DIM = 2, 2, 4, 64


address = server_fixture(*CPU_SERVER)
client = client_fixture("quantize")


def layout():
    return ModelLayout(LAYERS, HEADS, QHEADS, DIM, RopeParams(theta=500000.0))


def prompt(tokens, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((LAYERS, HEADS, tokens, DIM)).astype(np.float16),
            rng.standard_normal((LAYERS, HEADS, tokens, DIM)).astype(np.float16))


def stored_pages(client, sequence_id):
    """The raw pages of the sequence's quantized part (after the sink,
    before the fp16 tail), message by message, as bytes."""
    stats = client.stats(sequence_id)
    g = kvq.page_geometry(stats.scheme, DIM)
    end = g["sink"] + (stats.num_tokens - g["sink"]) // g["flush_tokens"] * g["flush_tokens"]
    assert end > g["sink"]
    return [(layer, begin, p.SerializeToString())
            for layer, begin, p in client.fetch_pages(sequence_id, token_begin=g["sink"],
                                                      token_end=end)]


@pytest.mark.parametrize("scheme", ["kivi4:g32:r128", "kivi2:g32:r128"])
def test_wire_bytes_are_the_stored_page_bytes(client, scheme):
    seq = client.create_sequence(layout(), scheme=scheme)
    k, v = prompt(1024, 1)
    r = client.append_prompt(seq.sequence_id, k, v, quantize=True)
    assert r.num_tokens == 1024
    g = kvq.page_geometry(seq.scheme, DIM)
    pages = LAYERS * HEADS * (1024 // g["page_tokens"]) * g["page_bytes"]
    # Every token went as pages: the payload is exactly the pages stored...
    assert r.wire_bytes == pages
    # ...which is what the server holds in pages: codes and scales. The
    # rest of what it stores is the fp16 residual window's allocation (empty
    # here) and each stream's header padding, which nothing sends.
    b = client.stats(seq.sequence_id).bytes
    assert r.wire_bytes == b.codes + b.scales + b.outliers
    assert r.bytes_stored == b.total == pages + b.residual + b.padding
    assert sum(len(p.page_data) for _, _, p in client.fetch_pages(seq.sequence_id)) == pages
    # ...and the messages add only framing (sequence name, chunk header).
    assert 0 < r.message_bytes - r.wire_bytes <= 128 * r.chunks
    # fp16 would have been 3.5x (kivi4) to 5.8x (kivi2) more.
    assert r.wire_bytes * 3 < k.nbytes + v.nbytes


@pytest.mark.parametrize("scheme", ["kivi4:g32:r128:sink=4", "kivi2:g32:r128",
                                    "kivi2:g32:r64:p8:outliers=1", "kivi4:pre_rope", "kivi3:rotate",
                                    "int8", "fp16", "bf16"])
def test_client_pages_are_the_servers_pages(client, scheme):
    # The same fp16 prompt, quantized by the server (dense on the wire) and
    # by the client (pages on the wire), in two appends each: the second
    # starts off a page boundary, so both splits have dense heads and tails.
    k, v = prompt(100 + 700, 2)
    by_server = client.create_sequence(layout(), scheme=scheme).sequence_id
    by_client = client.create_sequence(layout(), scheme=scheme).sequence_id
    results = []
    for part in (slice(0, 100), slice(100, 800)):
        client.append_prompt(by_server, k[:, :, part], v[:, :, part], quantize=False)
        results.append(client.append_prompt(by_client, k[:, :, part], v[:, :, part],
                                            quantize=True))
    dense = k[:, :, 100:].nbytes + v[:, :, 100:].nbytes
    assert results[1].wire_bytes < dense or scheme in ("fp16", "bf16")
    assert stored_pages(client, by_client) == stored_pages(client, by_server)
    for a, b in zip(client.fetch(by_client, dtype="fp32"), client.fetch(by_server, dtype="fp32")):
        assert (a == b).all()
    assert client.stats(by_client).bytes == client.stats(by_server).bytes


def test_nuq_pages_with_the_clients_codebooks(client):
    levels = np.tile(np.linspace(0, 1, 8) ** 1.5, (DIM, 1)).astype(np.float32)
    books = [(levels, levels)] * (LAYERS * HEADS)
    k, v = prompt(300, 5)
    by_server = client.create_sequence(layout(), scheme="kivi3:nuq", codebooks=books).sequence_id
    by_client = client.create_sequence(layout(), scheme="kivi3:nuq", codebooks=books).sequence_id
    client.append_prompt(by_server, k, v, quantize=False)
    r = client.append_prompt(by_client, k, v, quantize=True)
    assert r.wire_bytes < (k.nbytes + v.nbytes) / 2
    assert stored_pages(client, by_client) == stored_pages(client, by_server)


def test_bf16_torch_prompt_is_quantized_from_its_bits(client):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(3)
    k = torch.randn(LAYERS, HEADS, 300, DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(LAYERS, HEADS, 300, DIM, generator=g).to(torch.bfloat16)
    by_server = client.create_sequence(layout(), scheme="int8").sequence_id
    by_client = client.create_sequence(layout(), scheme="int8").sequence_id
    dense = client.append_prompt(by_server, k, v, quantize=False)
    assert dense.wire_bytes == 2 * k.numel() * 2  # bf16 bits, not fp32.
    client.append_prompt(by_client, k, v, quantize=True)
    assert stored_pages(client, by_client) == stored_pages(client, by_server)


def test_fp8_goes_dense_and_quantize_true_says_why(client):
    seq = client.create_sequence(layout(), scheme="fp8_e4m3")
    k, v = prompt(64, 4)
    with pytest.raises(ValueError, match="scheme fp8_e4m3 has no raw pages"):
        client.append_prompt(seq.sequence_id, k, v, quantize=True)
    r = client.append_prompt(seq.sequence_id, k, v)  # Default: dense where pages cannot go.
    assert r.num_tokens == 64 and r.wire_bytes == k.nbytes + v.nbytes
