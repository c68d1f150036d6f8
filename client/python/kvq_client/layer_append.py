"""LayerAppend: one Append stream fed a layer at a time.

KvqClient.append_prompt needs every layer's K and V at once. A model that
produces them layer by layer (a vLLM forward pass) would have to hold the
whole prompt's KV on the host until the last layer; this sends each layer's
chunks as soon as they are added, while later layers are still being
computed. The server commits the stream when finish() half-closes it, all or
nothing, like any Append; cancel() (or a failure) stores nothing.

Given the sequence's scheme and its stored length, each layer's tokens the
server would quantize go as raw pages quantized here (quantized_append.py),
as KvqClient.append_prompt sends them.
"""

import queue

import grpc
import numpy as np

from . import _proto, quantized_append
from .client import KvqError
from .tensors import prompt_arrays, to_tensor, wire_dtype

pb, _ = _proto.modules()

_END = object()


class LayerAppend:
    """Not thread-safe: one producer adds layers, then calls finish()."""

    def __init__(self, client, sequence_id, max_chunk_bytes=1 << 20, wire=None,
                 deadline=None, scheme=None, start_tokens=0, head_dim=None, token_ids=None):
        """scheme (the sequence's), start_tokens (the tokens it stores now)
        and head_dim: layers go as raw pages where the scheme has them and
        the native module is installed (nuq goes dense: no codebooks here);
        `wire` is then the dtype of the dense tokens other than kivi's (fp16).
        Without a scheme every token goes dense in `wire`. `token_ids`: ids
        of the appended tokens (AppendRequest.token_ids), sent first; kvq
        registers their completed blocks for prefix reuse."""
        self._client = client
        self._scheme = None
        native = quantized_append.native()
        if scheme is not None and head_dim is not None and native is not None:
            geometry = native.page_geometry(scheme, head_dim)
            if quantized_append.why_not_quantized(geometry, None) is None:
                self._scheme, self._geometry = geometry["scheme"], geometry
                self._start, self._head_dim = start_tokens, head_dim
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
        # k, v for the native quantizer (torch read in place); host_k, host_v
        # numpy for dense chunks (bfloat16 as its bits: bf16 on the wire).
        k, v, host_k, host_v = prompt_arrays(k[None], v[None])
        k, v, host_k, host_v = k[0], v[0], host_k[0], host_v[0]
        heads, tokens, dim = host_k.shape
        in_wire = wire_dtype(self._wire or ("bf16" if host_k.dtype == np.uint16
                                            else host_k.dtype))
        if self._scheme is not None:
            if dim != self._head_dim:
                raise ValueError(f"k has head_dim {dim}, the sequence {self._head_dim}")
            split = quantized_append.split_for_pages(self._geometry, self._start, tokens)
            wire = wire_dtype(quantized_append.dense_wire(self._geometry, in_wire))
        else:
            split, wire = quantized_append.dense_split(tokens), in_wire
        item = 4 if wire == pb.DTYPE_FP32 else 2
        for kind, _, _, t0, t, payload in quantized_append.plan_append(
                split, 1, heads, dim, item, self._max_chunk_bytes):
            request = self._request()
            request.chunk.layer_begin = layer
            if kind == "dense":
                to_tensor(host_k[None, :, t0:t0 + t], wire, out=request.chunk.k)
                to_tensor(host_v[None, :, t0:t0 + t], wire, out=request.chunk.v)
            else:
                quantized_append.fill_pages(request.chunk.pages, self._scheme, split,
                                            k[None, :, t0:t0 + t], v[None, :, t0:t0 + t])
            self.wire_bytes += payload
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
