"""Client-side quantization of a prompt append: which tokens go as raw
pages (kvq.v1.QuantizedPages, quantized here by kvq's native kernels) and
which as dense tensors.

The server takes raw pages only where its streams accept them (the sink
complete, the fp16 tail empty, the quantized part on a page and block
boundary): the first tokens of an append may have to fill the sink and
reach such a boundary, and the last may not fill a block. Those go dense;
everything between goes as pages, byte for byte what the server would have
stored (the C++ client's SplitForPages, client/append_plan.cc, does the
same split).
"""

import dataclasses
import math
from typing import List, Optional, Tuple

from .tensors import plan_chunks


@dataclasses.dataclass
class PageSplit:
    dense_head: int   # Tokens sent dense before the pages.
    paged: int        # Tokens sent as raw pages (a multiple of block_tokens).
    dense_tail: int   # Tokens sent dense after them.
    page_tokens: int
    page_bytes: int
    block_tokens: int


def split_for_pages(geometry, start_tokens, tokens):
    """The PageSplit of appending `tokens` tokens to a sequence storing
    `start_tokens`, for a scheme's kvq.page_geometry()."""
    if start_tokens < 0 or tokens < 0:
        raise ValueError(f"start_tokens ({start_tokens}) and tokens ({tokens}) must be >= 0")
    flush, page, block = (geometry["flush_tokens"], geometry["page_tokens"],
                          geometry["block_tokens"])
    sink = geometry["sink"]
    split = PageSplit(tokens, 0, 0, page, geometry["page_bytes"], block)
    if not geometry["raw_pages"]:
        return split
    align = math.lcm(flush, page, block)
    head = max(0, sink - start_tokens)
    stored_quantizable = max(start_tokens, sink) - sink
    head += (align - stored_quantizable % align) % align
    split.dense_head = min(head, tokens)
    rest = tokens - split.dense_head
    split.paged = rest // block * block
    split.dense_tail = rest - split.paged
    return split


def dense_split(tokens):
    """The PageSplit that sends every token dense."""
    return PageSplit(tokens, 0, 0, 0, 0, 1)


# (kind "dense" or "pages", layer_begin, layers, token_begin, tokens, payload bytes)
Chunk = Tuple[str, int, int, int, int, int]


def plan_append(split, layers, heads, dim, dense_item_bytes, max_chunk_bytes) -> List[Chunk]:
    """The chunks of an append of `layers` layers split by `split`: the
    dense head, the pages (whole page and block units per chunk), the dense
    tail, each within max_chunk_bytes of payload where a unit fits."""
    chunks = []
    token_bytes = 2 * heads * dim * dense_item_bytes
    for l0, n, t0, t in plan_chunks(layers, split.dense_head, token_bytes, max_chunk_bytes):
        chunks.append(("dense", l0, n, t0, t, n * t * token_bytes))
    if split.paged:
        unit = math.lcm(split.block_tokens, split.page_tokens)
        unit_bytes = heads * (unit // split.page_tokens) * split.page_bytes
        for l0, n, t0, t in plan_chunks(layers, split.paged, unit_bytes, max_chunk_bytes,
                                        token_unit=unit):
            pages = -(-t // split.page_tokens)
            chunks.append(("pages", l0, n, split.dense_head + t0, t,
                           n * heads * pages * split.page_bytes))
    for l0, n, t0, t in plan_chunks(layers, split.dense_tail, token_bytes, max_chunk_bytes):
        chunks.append(("dense", l0, n, split.dense_head + split.paged + t0, t,
                       n * t * token_bytes))
    return chunks


def fill_pages(out, scheme, split, k, v, codebooks=None):
    """Fills a kvq.v1.QuantizedPages with the pages of k and v ([layers,
    kv_heads, tokens, head_dim], the chunk's tokens), quantized here."""
    out.layers, out.tokens = k.shape[0], k.shape[2]
    out.page_bytes, out.page_tokens = split.page_bytes, split.page_tokens
    out.page_data = native().quantize_pages(scheme, k, v, codebooks=codebooks)


def native():
    """The kvq native module, or None where the package was installed without it."""
    try:
        import kvq._native as module
    except ImportError:
        return None
    return module


def dense_wire(geometry, input_wire):
    """The wire dtype of a quantized plan's dense chunks: fp16 for kivi
    without rotate (the server keeps sink and tail in fp16; fewer bytes and
    the same result), else the input's own."""
    if geometry["kivi"] and not geometry["rotate"]:
        return "fp16"
    return input_wire


def why_not_quantized(geometry, codebooks) -> Optional[str]:
    """Why a scheme's prompt cannot go as raw pages, or None when it can."""
    if not geometry["raw_pages"]:
        return f"scheme {geometry['scheme']} has no raw pages (its scale is per stream)"
    if geometry["nuq"] and codebooks is None:
        return (f"scheme {geometry['scheme']} has nuq and this client does not hold the "
                "sequence's codebooks (it did not create the sequence)")
    return None
