"""The client-side pieces of a quantized append that need no server: the
split into dense and page tokens (the C++ client's SplitForPages), chunks
in whole page units, and bf16 bits on the wire."""

import numpy as np
import pytest

import kvq
from kvq_client import to_tensor, from_tensor, plan_chunks
from kvq_client.quantized_append import split_for_pages
from kvq_client.tensors import float32_to_bf16_bits, prompt_arrays


def geometry(scheme):
    return kvq.page_geometry(scheme, 64)


@pytest.mark.parametrize("start, tokens, want", [
    (0, 1000, (0, 896, 104)),      # From empty: pages at once; the last partial block dense.
    (100, 700, (28, 640, 32)),     # Dense up to the next block boundary (128) first.
    (128, 100, (0, 0, 100)),       # Less than a block.
    (0, 127, (0, 0, 127)),
])
def test_split_kivi(start, tokens, want):
    s = split_for_pages(geometry("kivi4:g32:r128"), start, tokens)
    assert (s.dense_head, s.paged, s.dense_tail) == want
    assert s.block_tokens == 128 and s.page_tokens == 32


def test_split_fills_the_sink_first():
    s = split_for_pages(geometry("kivi2:g32:r128:sink=4"), 0, 4 + 256 + 5)
    assert (s.dense_head, s.paged, s.dense_tail) == (4, 256, 5)
    s = split_for_pages(geometry("kivi2:g32:r128:sink=4"), 2, 300)
    assert (s.dense_head, s.paged, s.dense_tail) == (2, 256, 42)


def test_split_per_token_schemes_go_in_pages():
    s = split_for_pages(geometry("int8"), 10, 100)
    g = geometry("int8")
    assert s.block_tokens == g["page_tokens"]
    assert s.dense_head == (-10) % g["page_tokens"]
    assert s.paged % g["page_tokens"] == 0 and s.dense_head + s.paged + s.dense_tail == 100


def test_fp8_has_no_pages():
    s = split_for_pages(geometry("fp8_e4m3"), 0, 1000)
    assert (s.dense_head, s.paged, s.dense_tail) == (1000, 0, 0)


def test_plan_chunks_in_units():
    # Units of 128 tokens costing 1000 bytes, at most 2500 bytes a chunk:
    # a layer (4 units) does not fit, so 256-token pieces of one layer.
    assert plan_chunks(2, 512, 1000, 2500, token_unit=128) == [
        (0, 1, 0, 256), (0, 1, 256, 256), (1, 1, 0, 256), (1, 1, 256, 256)]
    assert plan_chunks(3, 512, 1000, 8000, token_unit=128) == [(0, 2, 0, 512), (2, 1, 0, 512)]


def test_bf16_bits_travel_as_they_are():
    x = np.array([1.0, -2.5, 3.14159, 448.0], np.float32)
    bits = float32_to_bf16_bits(x)
    t = to_tensor(bits)  # uint16: bf16 bits, no conversion.
    assert t.data == bits.astype("<u2").tobytes()
    assert (from_tensor(t) == (bits.astype(np.uint32) << 16).view(np.float32)).all()
    # Converted to fp16 through their exact float32 values.
    assert (from_tensor(to_tensor(bits, "fp16")) ==
            (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float16)).all()


def test_prompt_arrays_checks_the_shape():
    k = np.zeros((1, 2, 3, 4), np.float16)
    _, _, hk, hv = prompt_arrays(k, k.astype(np.float32))  # Two dtypes: float32.
    assert hk.dtype == np.float32 and hv.dtype == np.float32
    with pytest.raises(ValueError, match="must both be"):
        prompt_arrays(k[0], k[0])
