"""LayerAppend: one Append stream fed a layer at a time.

KvqClient.append_prompt needs every layer's K and V at once. A model that
produces them layer by layer (a vLLM forward pass) would have to hold the
whole prompt's KV on the host until the last layer; this sends each layer's
chunks as soon as they are added, while later layers are still being
computed. The server commits the stream when finish() half-closes it, all or
nothing, like any Append; cancel() (or a failure) stores nothing.

With `quantize` (LayerAppend.quantizer) each layer's tokens that the server
would quantize travel as raw pages made here by kvq's native kernels
(QuantizedPages, byte for byte the server's), the rest dense, as
KvqClient.append_prompt splits them (quantized_append.py).
"""

import math
import queue

import grpc
import numpy as np

from . import _proto, quantized_append
from .client import KvqError
from .tensors import plan_chunks, prompt_arrays, to_tensor, wire_dtype

pb, _ = _proto.modules()

_END = object()


class LayerAppend:
    """Not thread-safe: one producer adds layers, then calls finish()."""

    @staticmethod
    def quantizer(scheme, head_dim):
        """(canonical scheme, page geometry) for `quantize`, or None where
        the native module is missing or the scheme has no raw pages (fp8,
        nuq: its codebooks live with the sequence's creator)."""
        native = quantized_append.native()
        if native is None:
            return None
        geometry = native.page_geometry(scheme, head_dim)
        if quantized_append.why_not_quantized(geometry, None) is not None:
            return None
        return geometry["scheme"], geometry

    def __init__(self, client, sequence_id, max_chunk_bytes=1 << 20, wire=None,
                 deadline=None, token_ids=None, quantize=None, start_tokens=0):
        """`token_ids`: ids of the appended tokens (AppendRequest.token_ids),
        sent first; kvq registers their completed blocks for prefix reuse.
        `quantize`: LayerAppend.quantizer()'s answer for the sequence's
        scheme, with `start_tokens` the tokens it stores now (every layer)."""
        self._client = client
        self._sequence_id = sequence_id
        self._max_chunk_bytes = max_chunk_bytes
        self._wire = wire
        self._requests = queue.Queue()
        self._named = False
        self._done = False
        timeout = client.deadline if deadline is None else deadline
        self._future = client._stub.Append.future(iter(self._requests.get, _END),
                                                  timeout=timeout)
        self.wire_bytes = 0
        self._quantize = quantize
        self._start = start_tokens
        if token_ids:
            request = self._request()
            request.token_ids.extend(int(t) for t in token_ids)
            self._requests.put(request)

    def _request(self):
        request = pb.AppendRequest()
        if not self._named:
            self._client._ref(self._sequence_id, request.sequence)
            self._named = True
        return request

    def add_layer(self, layer, k, v):
        """Appends k, v ([kv_heads, tokens, head_dim]: numpy float32/float16
        or torch CPU tensors, bfloat16 too) at the end of `layer`, in chunks
        of at most max_chunk_bytes."""
        if self._done:
            raise KvqError(grpc.StatusCode.FAILED_PRECONDITION, "layer append finished")
        if k.ndim != 3 or tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                             "[kv_heads, tokens, head_dim]")
        k, v, host_k, host_v = prompt_arrays(k[None], v[None])
        in_wire = "bf16" if host_k.dtype == np.uint16 else host_k.dtype
        wire = wire_dtype(self._wire or in_wire)
        _, heads, tokens, dim = host_k.shape
        if self._quantize is None:
            split = quantized_append.PageSplit(tokens, 0, 0, 0, 0, 1)
        else:
            scheme, geometry = self._quantize
            split = quantized_append.split_for_pages(geometry, self._start, tokens)
            wire = wire_dtype(quantized_append.dense_wire(geometry, in_wire))
        item = 4 if wire == pb.DTYPE_FP32 else 2
        self._dense(layer, host_k, host_v, 0, split.dense_head, wire, 2 * heads * dim * item)
        if split.paged:
            unit = math.lcm(split.block_tokens, split.page_tokens)
            unit_bytes = heads * (unit // split.page_tokens) * split.page_bytes
            for _, _, t0, t in plan_chunks(1, split.paged, unit_bytes, self._max_chunk_bytes,
                                           token_unit=unit):
                t0 += split.dense_head
                request = self._request()
                request.chunk.layer_begin = layer
                p = request.chunk.pages
                p.layers, p.tokens = 1, t
                p.page_bytes, p.page_tokens = split.page_bytes, split.page_tokens
                p.page_data = quantized_append.native().quantize_pages(
                    scheme, k[:, :, t0:t0 + t], v[:, :, t0:t0 + t])
                self.wire_bytes += len(p.page_data)
                self._requests.put(request)
        self._dense(layer, host_k, host_v, split.dense_head + split.paged, split.dense_tail,
                    wire, 2 * heads * dim * item)

    def _dense(self, layer, host_k, host_v, begin, tokens, wire, token_bytes):
        for _, _, t0, t in plan_chunks(1, tokens, token_bytes, self._max_chunk_bytes):
            t0 += begin
            request = self._request()
            request.chunk.layer_begin = layer
            to_tensor(host_k[:, :, t0:t0 + t], wire, out=request.chunk.k)
            to_tensor(host_v[:, :, t0:t0 + t], wire, out=request.chunk.v)
            self.wire_bytes += len(request.chunk.k.data) + len(request.chunk.v.data)
            self._requests.put(request)

    def finish(self):
        """Half-closes the stream and waits for the commit; the sequence's
        token count after it. Raises KvqError if anything failed."""
        if not self._done:
            self._done = True
            if not self._named:
                self._requests.put(self._request())
            self._requests.put(_END)
        try:
            return self._future.result().num_tokens
        except grpc.RpcError as e:
            raise KvqError.from_rpc_error(e) from None
        except grpc.FutureCancelledError:
            raise KvqError(grpc.StatusCode.CANCELLED, "layer append cancelled") from None

    def cancel(self):
        """Abandons the stream: nothing of it is stored."""
        self._future.cancel()
        if not self._done:
            self._done = True
            self._requests.put(_END)
