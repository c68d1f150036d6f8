"""LayerAppend: one Append stream fed a layer at a time.

KvqClient.append_prompt needs every layer's K and V at once. A model that
produces them layer by layer (a vLLM forward pass) would have to hold the
whole prompt's KV on the host until the last layer; this sends each layer's
chunks as soon as they are added, while later layers are still being
computed. The server commits the stream when finish() half-closes it, all or
nothing, like any Append; cancel() (or a failure) stores nothing.
"""

import queue

import grpc
import numpy as np

from . import _proto
from .client import KvqError
from .tensors import plan_chunks, to_tensor, wire_dtype

pb, _ = _proto.modules()

_END = object()


class LayerAppend:
    """Not thread-safe: one producer adds layers, then calls finish()."""

    def __init__(self, client, sequence_id, max_chunk_bytes=1 << 20, wire=None,
                 deadline=None, token_ids=None):
        """`token_ids`: ids of the appended tokens (AppendRequest.token_ids),
        sent first; kvq registers their completed blocks for prefix reuse."""
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
        """Appends k, v ([kv_heads, tokens, head_dim], float32 or float16) at
        the end of `layer`, in chunks of at most max_chunk_bytes."""
        if self._done:
            raise KvqError(grpc.StatusCode.FAILED_PRECONDITION, "layer append finished")
        k = np.asarray(k)
        v = np.asarray(v)
        if k.ndim != 3 or k.shape != v.shape:
            raise ValueError(f"k {k.shape} and v {v.shape} must both be "
                             "[kv_heads, tokens, head_dim]")
        wire = wire_dtype(self._wire or k.dtype)
        item = 4 if wire == pb.DTYPE_FP32 else 2
        heads, tokens, dim = k.shape
        for _, _, t0, t in plan_chunks(1, tokens, 2 * heads * dim * item, self._max_chunk_bytes):
            request = self._request()
            request.chunk.layer_begin = layer
            to_tensor(k[None, :, t0:t0 + t], wire, out=request.chunk.k)
            to_tensor(v[None, :, t0:t0 + t], wire, out=request.chunk.v)
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
