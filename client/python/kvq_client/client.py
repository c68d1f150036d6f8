"""KvqClient: the Python client of the kvq.v1.KvCache service.

numpy arrays in and out; every call has a deadline (the client's unless the
call passes one); idempotent calls (info, fetch, attend, stats, release) are
retried with exponential backoff on UNAVAILABLE and DEADLINE_EXCEEDED, calls
that change state (create_sequence, append_prompt, append_attend, decode
sessions, fork) never are. A release retried after a lost reply treats
NOT_FOUND as success. Errors raise KvqError with the server's status code and
message (the codes are listed in proto/kvq/v1/kvq.proto).

A prefill worker::

    from kvq_client import KvqClient, ModelLayout
    with KvqClient("kvq:50051", namespace="tenant-a") as kvq:
        seq = kvq.create_sequence(ModelLayout(32, 8, 32, 128), scheme="kivi2:g32:r128")
        kvq.append_prompt(seq.sequence_id, k, v)   # [layers, kv_heads, tokens, head_dim]

A decode worker (one stream for the whole decode loop, one request per layer
per step, many sequences batched per request)::

    import numpy as np
    from kvq_client import KvqClient, DecodeItem

    with KvqClient("kvq:50051", namespace="tenant-a") as kvq:
        with kvq.decode_session() as session:
            for step in range(max_new_tokens):
                for layer in range(num_layers):
                    q, k, v = model.qkv(layer, hidden)   # post-RoPE q, this step's k/v
                    items = [DecodeItem(seq_id, k[i], v[i], q[i])
                             for i, seq_id in enumerate(batch)]
                    # k, v: [kv_heads, 1, head_dim]; q: [1, num_q_heads, head_dim]
                    results = session.step(layer, items)
                    attn = np.stack([out for out, lse in results])
                    hidden = model.finish_layer(layer, attn)
        for seq_id in batch:
            kvq.release(seq_id)

TLS and mutual TLS: ``KvqClient("kvq:50051", tls_ca="ca.pem")`` trusts that
CA bundle; add ``tls_cert=`` and ``tls_key=`` for a server that requires
client certificates, ``tls_server_name=`` when the target's host is not a name
the server's certificate holds, and ``tls=True`` alone for the system roots.

append_prompt quantizes on the client (raw pages made by kvq's native
kernels, the `kvq` module of this package) wherever the scheme allows.
"""

import dataclasses
import itertools
import queue
import random
import threading
import time
from typing import Callable, List, Optional, Sequence

import grpc
import numpy as np

from . import _proto, quantized_append
from .auth import with_token
from .tensors import assemble_fetch, from_tensor, to_tensor
from .tensors import prompt_arrays as _prompt_arrays
from .tensors import wire_dtype as _wire_dtype

pb, pb_grpc = _proto.modules()
_native = quantized_append.native

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class KvqError(Exception):
    """A failed kvq call: `code` is a grpc.StatusCode, `details` the server's message."""

    def __init__(self, code, details):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, e):
        return cls(e.code(), e.details())


@dataclasses.dataclass
class RetryPolicy:
    max_attempts: int = 4          # 1 disables retries.
    initial_backoff: float = 0.05  # Seconds.
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2            # Each wait scaled by a random factor in [1-j, 1+j].

    def backoff(self, retry):
        """Seconds before retry number `retry` (1-based), without jitter."""
        return min(self.initial_backoff * self.multiplier ** (retry - 1), self.max_backoff)


@dataclasses.dataclass
class RopeParams:
    theta: float = 10000.0
    rotary_dim: int = 0               # 0: head_dim.
    pairing: str = "half_split"       # or "adjacent".
    scaling: str = "none"             # "linear", "ntk".
    factor: float = 1.0


@dataclasses.dataclass
class ModelLayout:
    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    rope: RopeParams = dataclasses.field(default_factory=RopeParams)

    def to_proto(self):
        m = pb.ModelLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                           num_q_heads=self.num_q_heads, head_dim=self.head_dim)
        r = self.rope
        m.rope.theta = r.theta
        m.rope.rotary_dim = r.rotary_dim
        m.rope.pairing = {"half_split": pb.RopeParams.PAIRING_HALF_SPLIT,
                          "adjacent": pb.RopeParams.PAIRING_ADJACENT}[r.pairing]
        m.rope.scaling = {"none": pb.RopeParams.SCALING_NONE,
                          "linear": pb.RopeParams.SCALING_LINEAR,
                          "ntk": pb.RopeParams.SCALING_NTK}[r.scaling]
        m.rope.factor = r.factor
        return m


def _fill_prefix_fields(request, layout, prompt_token_ids, codebooks, calibration=""):
    """The fields CreateSequence and MatchPrefix share: layout, prompt ids,
    codebooks (nuq: (key_levels, value_levels) per (layer, kv head)) and the
    calibration name (crq schemes)."""
    request.layout.CopyFrom(layout.to_proto() if isinstance(layout, ModelLayout) else layout)
    request.calibration = calibration or ""
    request.prompt_token_ids.extend(prompt_token_ids or [])
    for key_levels, value_levels in codebooks or []:
        c = request.codebooks.add()
        to_tensor(np.asarray(key_levels, np.float32), out=c.key_levels)
        to_tensor(np.asarray(value_levels, np.float32), out=c.value_levels)


@dataclasses.dataclass
class MatchResult:
    """MatchPrefix's answer: the leading prompt tokens a create_sequence with
    the same layout and scheme would reuse now (0 or sink + k * block)."""
    matched_tokens: int
    block_tokens: int


@dataclasses.dataclass
class SequenceInfo:
    sequence_id: str
    scheme: str        # Canonical.
    num_tokens: int    # A reused prefix already present.
    block_tokens: int
    ttl_seconds: int = 0  # The idle lease granted (capped to the server's maximum).


@dataclasses.dataclass
class AppendResult:
    num_tokens: int
    bytes_stored: int
    wire_bytes: int     # Payload: tensor data and page bytes.
    chunks: int
    message_bytes: int = 0  # The Append messages as serialized, framing included.


@dataclasses.dataclass
class AttendQuery:
    sequence_id: str
    q: np.ndarray                       # Post-RoPE [num_queries, num_q_heads, head_dim].
    q_positions: Optional[Sequence[int]] = None  # None: every stored token is visible.
    key_begin: int = 0
    key_end: int = 0                    # 0: all stored tokens.


@dataclasses.dataclass
class DecodeItem:
    sequence_id: str
    k: np.ndarray   # [kv_heads, tokens, head_dim]
    v: np.ndarray
    q: np.ndarray   # [tokens, num_q_heads, head_dim]


Progress = Callable[[int, int], None]  # (done_bytes, total_bytes or -1).


def _results(response):
    return [(from_tensor(r.out, f"results[{i}].out"), from_tensor(r.lse, f"results[{i}].lse"))
            for i, r in enumerate(response.results)]


def _packed(response):
    """(out, lse) of a packed reply (AttendBatch, AppendAttendBatch)."""
    if not response.HasField("out"):
        raise KvqError(grpc.StatusCode.UNIMPLEMENTED,
                       "the server answered without a packed out/lse: it predates the "
                       "packed form")
    return from_tensor(response.out, "out"), from_tensor(response.lse, "lse")


class _ClosedOnExit:
    """Decode sessions as context managers: close() (which raises the
    stream's error) when the block ends normally, cancel() when it raises,
    so that the block's own exception is the one that propagates."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.cancel()


class DecodeSession(_ClosedOnExit):
    """A DecodeStream: write() sends one layer's append+attend for some
    sequences, read() returns the results in write order; step() does both.
    Not thread-safe. Use as a context manager or call close()."""

    _END = object()

    def __init__(self, client, stub, timeout):
        self._client = client
        self._requests = queue.Queue()
        self._responses = stub.DecodeStream(iter(self._requests.get, self._END), timeout=timeout)
        self._closed = False

    def _check_open(self):
        if self._closed:
            raise KvqError(grpc.StatusCode.FAILED_PRECONDITION, "decode session closed")

    def _next_result(self):
        try:
            return next(self._responses).result
        except StopIteration:
            raise KvqError(grpc.StatusCode.UNAVAILABLE, "decode stream closed by the server")
        except grpc.RpcError as e:
            raise KvqError.from_rpc_error(e) from None

    def write(self, layer, items, softmax_scale=0.0):
        self._check_open()
        request = pb.DecodeRequest()
        self._client._fill_append_attend(request.step, layer, items, softmax_scale)
        self._requests.put(request)

    def read(self):
        return _results(self._next_result())

    def step(self, layer, items, softmax_scale=0.0):
        self.write(layer, items, softmax_scale)
        return self.read()

    def write_batch(self, layer, sequence_ids, k, v, q, softmax_scale=0.0):
        """The packed form of write(): k, v [n, kv_heads, head_dim] and q
        [n, num_q_heads, head_dim], row i for sequence_ids[i]; read its reply
        with read_batch()."""
        self._check_open()
        request = pb.DecodeRequest()
        self._client._fill_append_attend_batch(request.step, layer, sequence_ids, k, v, q,
                                               softmax_scale)
        self._requests.put(request)

    def read_batch(self):
        """(out, lse) of a write_batch(), packed."""
        return _packed(self._next_result())

    def step_batch(self, layer, sequence_ids, k, v, q, softmax_scale=0.0):
        self.write_batch(layer, sequence_ids, k, v, q, softmax_scale)
        return self.read_batch()

    def close(self):
        """Half-closes, drains unread results and raises the stream's error, if any."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(self._END)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError as e:
            raise KvqError.from_rpc_error(e) from None

    def cancel(self):
        self._closed = True
        self._requests.put(self._END)
        self._responses.cancel()


def _place_fetch(messages, K, V, layer_begin, token_begin, progress):
    """Copies dense FetchDequant messages into K, V [layers, kv_heads, tokens,
    head_dim], checking that each continues its layer's range and that the
    stream covers it all (DATA_LOSS otherwise)."""
    layers, heads, tokens, d = K.shape
    filled, done = [0] * layers, 0
    for m in messages:
        k = from_tensor(m.k, "k")
        v = from_tensor(m.v, "v")
        l, t0 = m.layer - layer_begin, m.token_begin - token_begin
        n = k.shape[1] if k.ndim == 3 else -1
        if (k.shape != v.shape or n < 0 or k.shape[0] != heads or k.shape[2] != d
                or not 0 <= l < layers or t0 != filled[l] or t0 + n > tokens):
            raise KvqError(grpc.StatusCode.DATA_LOSS,
                           f"fetch response for layer {m.layer} token {m.token_begin} "
                           f"{k.shape} does not continue the range")
        K[l, :, t0:t0 + n] = k
        V[l, :, t0:t0 + n] = v
        filled[l] += n
        done += len(m.k.data) + len(m.v.data)
        if progress:
            progress(done, 2 * K.nbytes)
    for l, f in enumerate(filled):
        if f != tokens:
            raise KvqError(grpc.StatusCode.DATA_LOSS,
                           f"fetch stream ended with {f} of {tokens} tokens of layer "
                           f"{layer_begin + l}")

def _read_pem(name, path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{name}={path}: cannot read ({e.strerror})") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{name}={path}: no PEM block in the file")
    return data


def _tls_credentials(tls, ca, cert, key, server_name):
    """grpc.ssl_channel_credentials from PEM files; None for plaintext."""
    if bool(cert) != bool(key):
        raise ValueError("tls_cert and tls_key go together: a client certificate needs both")
    if not (tls or ca or cert):
        if server_name:
            raise ValueError("tls_server_name is set without TLS (tls, tls_ca or tls_cert)")
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem("tls_ca", ca) if ca else None,
        private_key=_read_pem("tls_key", key) if key else None,
        certificate_chain=_read_pem("tls_cert", cert) if cert else None)


class KvqClient:
    """Client of one kvq server and one namespace. Thread-safe."""

    def __init__(self, target="localhost:50051", namespace="", deadline=30.0,
                 retry=None, max_message_bytes=64 << 20, channel=None, tls=False,
                 tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None, token=None):
        """`token`: the tenant's bearer token (a server with --tokens_file),
        sent on every call, stream and retry."""
        self.namespace = namespace
        self.deadline = deadline
        self.retry = retry or RetryPolicy()
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        self._own_channel = channel is None
        if channel is None:
            creds = _tls_credentials(tls, tls_ca, tls_cert, tls_key, tls_server_name)
            if creds is None:
                channel = grpc.insecure_channel(target, options=options)
            else:
                if tls_server_name:
                    options.append(("grpc.ssl_target_name_override", tls_server_name))
                channel = grpc.secure_channel(target, creds, options=options)
        self._channel = channel
        self._stub = pb_grpc.KvCacheStub(with_token(self._channel, token))
        self._rng = random.Random()
        self._rng_lock = threading.Lock()
        # nuq codebooks of the sequences this client created, as the native
        # quantizer takes them: append_prompt quantizes such sequences here.
        self._codebooks = {}

    def close(self):
        if self._own_channel:
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ plumbing

    def _ref(self, sequence_id, out):
        out.namespace = self.namespace
        out.sequence_id = sequence_id

    def _call(self, fn, idempotent, deadline=None, on_retry_status=None):
        """Runs fn(timeout, attempt) with retries for idempotent calls."""
        timeout = self.deadline if deadline is None else deadline
        attempts = max(self.retry.max_attempts, 1) if idempotent else 1
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                with self._rng_lock:
                    jitter = self._rng.uniform(1 - self.retry.jitter, 1 + self.retry.jitter)
                time.sleep(self.retry.backoff(attempt - 1) * jitter)
            try:
                return fn(timeout, attempt)
            except grpc.RpcError as e:
                if on_retry_status is not None and attempt > 1:
                    handled = on_retry_status(e.code())
                    if handled is not None:
                        return handled
                if e.code() not in _RETRYABLE or attempt == attempts:
                    raise KvqError.from_rpc_error(e) from None

    def _fill_append_attend(self, request, layer, items, softmax_scale):
        request.layer = layer
        request.softmax_scale = softmax_scale
        for it in items:
            if not isinstance(it, DecodeItem):
                it = DecodeItem(*it)
            item = request.items.add()
            self._ref(it.sequence_id, item.sequence)
            for name, array, rank in (("k", it.k, 3), ("v", it.v, 3), ("q", it.q, 3)):
                if np.ndim(array) != rank:
                    raise ValueError(f"{name} must have rank {rank}, got shape {np.shape(array)}")
                to_tensor(array, out=getattr(item, name))

    def _fill_append_attend_batch(self, request, layer, sequence_ids, k, v, q, softmax_scale):
        ids = list(sequence_ids)
        for name, array in (("k", k), ("v", v), ("q", q)):
            if np.ndim(array) != 3 or not ids or np.shape(array)[0] != len(ids):
                raise ValueError(f"{name} must be [{len(ids)} sequences (at least one), heads, "
                                 f"head_dim], got {np.shape(array)}")
        request.layer = layer
        request.softmax_scale = softmax_scale
        for sequence_id in ids:
            self._ref(sequence_id, request.items.add().sequence)
        to_tensor(k, out=request.k)
        to_tensor(v, out=request.v)
        to_tensor(q, out=request.q)

    # ---------------------------------------------------------------- RPCs

    def info(self, deadline=None):
        """ServerInfo (a kvq.v1 message): version, backend, schemes, limits."""
        return self._call(lambda t, _: self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=t),
                          idempotent=True, deadline=deadline)

    def create_sequence(self, layout, scheme="kivi4:g32:r128:sink=4", sequence_id="", ttl_seconds=0,
                        prompt_token_ids=None, codebooks=None, deadline=None,
                        calibration: str = ""):
        """Creates a sequence; `codebooks` (nuq) is a list of (key_levels,
        value_levels) float32 arrays [head_dim, 2^bits] per (layer, kv head);
        `calibration` (crq schemes) names a calibration the server has loaded
        (info().calibrations)."""
        request = pb.CreateSequenceRequest(namespace=self.namespace, sequence_id=sequence_id,
                                           scheme=scheme, ttl_seconds=ttl_seconds)
        _fill_prefix_fields(request, layout, prompt_token_ids, codebooks, calibration)
        r = self._call(lambda t, _: self._stub.CreateSequence(request, timeout=t),
                       idempotent=False, deadline=deadline)
        if codebooks:
            self._codebooks[r.sequence_id] = [
                (np.asarray(kl, np.float32).ravel().tolist(),
                 np.asarray(vl, np.float32).ravel().tolist()) for kl, vl in codebooks]
        return SequenceInfo(r.sequence_id, r.scheme, r.num_tokens, r.block_tokens, r.ttl_seconds)

    def match_prefix(self, layout, scheme="kivi4:g32:r128:sink=4", prompt_token_ids=None,
                     codebooks=None, deadline=None, calibration: str = ""):
        """Read-only probe of the server's prefix cache (MatchPrefix): how
        many leading tokens of prompt_token_ids a create_sequence with this
        layout, scheme, codebooks and calibration would start with. Creates,
        forks, pins and extends the lease of nothing; idempotent (retried)."""
        request = pb.MatchPrefixRequest(namespace=self.namespace, scheme=scheme)
        _fill_prefix_fields(request, layout, prompt_token_ids, codebooks, calibration)
        r = self._call(lambda t, _: self._stub.MatchPrefix(request, timeout=t),
                       idempotent=True, deadline=deadline)
        return MatchResult(r.matched_tokens, r.block_tokens)

    def append_prompt(self, sequence_id, k, v, layer_begin=0, max_chunk_bytes=1 << 20,
                      wire_dtype=None, token_ids=None, progress: Optional[Progress] = None,
                      deadline=None, transport="grpc", quantize=None):
        """Streams k and v ([layers, kv_heads, tokens, head_dim]: numpy
        float32/float16, or torch CPU tensors, bfloat16 too) in chunks of at
        most max_chunk_bytes: one all-or-nothing append.

        quantize=None (the default) quantizes here where it can: the tokens
        the server would quantize go as raw pages (QuantizedPages), made by
        kvq's native kernels (the `kvq` module of this package) byte for
        byte as the server would have made them, so only stored bytes
        travel; the sink and the tokens before a page boundary or after the
        last whole block go dense (fp16 for kivi). It can where wire_dtype
        is not given and the sequence's scheme has raw pages (every scheme
        but fp8_e4m3; nuq only for a sequence this client created with its
        codebooks); one Stats call reads the sequence's scheme and length
        first. quantize=True insists (ValueError where it cannot);
        quantize=False sends every token dense.

        Dense tokens travel in `wire_dtype` ('fp32', 'fp16', 'bf16'),
        default the input's own: bfloat16 torch tensors as bf16 bits.

        transport="cuda_ipc": k and v are contiguous CUDA torch tensors on
        this node; the server copies them GPU to GPU through CUDA IPC
        handles and only descriptors travel (docs/TRANSPORT.md). "nccl" is
        offered by the C++ client (NcclPeer) only."""
        if _check_transport(transport) != "grpc":
            return self._append_device(sequence_id, k, v, layer_begin, token_ids, deadline,
                                       transport)
        k, v, host_k, host_v = _prompt_arrays(k, v)
        layers, heads, tokens, dim = host_k.shape
        in_wire = "bf16" if host_k.dtype == np.uint16 else host_k.dtype
        dense = _wire_dtype(wire_dtype or in_wire)
        scheme, geometry = None, None
        quantized = self._quantized_layout(sequence_id, dim, quantize, wire_dtype, deadline)
        if quantized is not None:
            scheme, geometry, start = quantized
            dense = _wire_dtype(quantized_append.dense_wire(geometry, in_wire))
            split = quantized_append.split_for_pages(geometry, start, tokens)
        else:
            split = quantized_append.dense_split(tokens)
        item = {pb.DTYPE_FP32: 4, pb.DTYPE_FP16: 2, pb.DTYPE_BF16: 2}[dense]
        chunks = quantized_append.plan_append(split, layers, heads, dim, item, max_chunk_bytes)
        total = sum(c[-1] for c in chunks)
        codebooks = self._codebooks.get(sequence_id)
        sent = {"bytes": 0, "chunks": 0, "message_bytes": 0}

        def requests():
            if progress:
                progress(0, total)
            first = pb.AppendRequest()
            self._ref(sequence_id, first.sequence)
            first.token_ids.extend(token_ids or [])
            if not chunks:
                yield first
            for i, (kind, l0, n, t0, t, payload) in enumerate(chunks):
                request = first if i == 0 else pb.AppendRequest()
                request.chunk.layer_begin = layer_begin + l0
                if kind == "dense":
                    to_tensor(host_k[l0:l0 + n, :, t0:t0 + t], dense, out=request.chunk.k)
                    to_tensor(host_v[l0:l0 + n, :, t0:t0 + t], dense, out=request.chunk.v)
                else:
                    books = None
                    if geometry["nuq"]:
                        first_book = (layer_begin + l0) * heads
                        books = codebooks[first_book:first_book + n * heads]
                    quantized_append.fill_pages(request.chunk.pages, scheme, split,
                                                k[l0:l0 + n, :, t0:t0 + t],
                                                v[l0:l0 + n, :, t0:t0 + t], books)
                sent["message_bytes"] += request.ByteSize()
                yield request
                sent["bytes"] += payload
                sent["chunks"] += 1
                if progress:
                    progress(sent["bytes"], total)

        r = self._call(lambda t, _: self._stub.Append(requests(), timeout=t),
                       idempotent=False, deadline=deadline)
        return AppendResult(r.num_tokens, r.bytes_stored, sent["bytes"], sent["chunks"],
                            sent["message_bytes"])

    def _quantized_layout(self, sequence_id, head_dim, quantize, wire_dtype, deadline):
        """(canonical scheme, kvq.page_geometry, stored tokens) when an
        append to the sequence goes as raw pages quantized here, else None
        (ValueError with quantize=True)."""
        if quantize is False or (quantize is None and wire_dtype is not None):
            return None
        native = _native()
        why = None
        if native is None:
            why = "the kvq native module is not installed"
        elif wire_dtype is not None:
            why = "wire_dtype is given: raw pages have no wire dtype"
        else:
            stats = self.stats(sequence_id, deadline=deadline)
            geometry = native.page_geometry(stats.scheme, head_dim)
            why = quantized_append.why_not_quantized(geometry,
                                                     self._codebooks.get(sequence_id))
            if why is None:
                return geometry["scheme"], geometry, stats.num_tokens
        if quantize:
            raise ValueError(f"append_prompt(quantize=True): {why}")
        return None

    def fetch_pages(self, sequence_id, layer_begin=0, layer_end=0, token_begin=0, token_end=0,
                    max_chunk_bytes=0, deadline=None):
        """The raw stored pages of a range of the quantized part (FetchRequest
        raw): [(layer, token_begin, QuantizedPages)] in the server's order,
        each page_data [layer][kv_head][page] as the server stores them.
        Retried as a whole."""
        request = pb.FetchRequest(layer_begin=layer_begin, layer_end=layer_end,
                                  token_begin=token_begin, token_end=token_end, raw=True,
                                  max_chunk_bytes=max_chunk_bytes)
        self._ref(sequence_id, request.sequence)

        def run(timeout, _):
            return [(m.layer, m.token_begin, m.pages)
                    for m in self._stub.FetchDequant(request, timeout=timeout)]

        return self._call(run, idempotent=True, deadline=deadline)

    def fetch(self, sequence_id, layer_begin=0, layer_end=0, token_begin=0, token_end=0,
              dtype="fp16", apply_rope=False, max_chunk_bytes=0,
              progress: Optional[Progress] = None, deadline=None, out=None):
        """Dequantized (K, V), each [layers, kv_heads, tokens, head_dim]
        (float16 for 'fp16', float32 for 'fp32' and 'bf16'). Retried as a
        whole.

        out=(K, V): arrays the caller owns and may reuse, C-contiguous, of
        that shape and dtype; their shape sets the range (from layer_begin
        and token_begin; layer_end / token_end must be 0 or agree). Each
        message is copied into place as it arrives and (K, V) is returned."""
        if out is not None:
            return self._fetch_into(sequence_id, layer_begin, layer_end, token_begin, token_end,
                                    dtype, apply_rope, max_chunk_bytes, progress, deadline, out)
        request = pb.FetchRequest(layer_begin=layer_begin, layer_end=layer_end,
                                  token_begin=token_begin, token_end=token_end,
                                  dtype=_wire_dtype(dtype), apply_rope=apply_rope,
                                  max_chunk_bytes=max_chunk_bytes)
        self._ref(sequence_id, request.sequence)

        want = np.float16 if _wire_dtype(dtype) == pb.DTYPE_FP16 else np.float32

        def run(timeout, _):
            stream = iter(self._stub.FetchDequant(request, timeout=timeout))
            first = next(stream, None)
            if first is None:
                raise KvqError(grpc.StatusCode.DATA_LOSS,
                               "the fetch stream ended without a message")
            messages = itertools.chain([first], stream)
            if first.range_layer_end > 0 and len(first.k.shape) == 3:
                # The first message states the range: one allocation, each
                # message copied into place as it arrives.
                layers = first.range_layer_end - layer_begin
                tokens = first.range_token_end - token_begin
                K = np.empty((layers, first.k.shape[0], tokens, first.k.shape[2]), want)
                V = np.empty_like(K)
                _place_fetch(messages, K, V, layer_begin, token_begin, progress)
                return layer_begin, token_begin, K, V
            pieces, done = [], 0  # A server that does not state the range.
            for m in messages:
                k = from_tensor(m.k, "k")
                v = from_tensor(m.v, "v")
                pieces.append((m.layer, m.token_begin, k, v))
                done += len(m.k.data) + len(m.v.data)
                if progress:
                    progress(done, -1)
            return assemble_fetch(pieces)

        _, _, K, V = self._call(run, idempotent=True, deadline=deadline)
        return K, V

    def _fetch_into(self, sequence_id, layer_begin, layer_end, token_begin, token_end, dtype,
                    apply_rope, max_chunk_bytes, progress, deadline, out):
        K, V = out
        want = np.float16 if _wire_dtype(dtype) == pb.DTYPE_FP16 else np.float32
        for name, a in (("K", K), ("V", V)):
            if (not isinstance(a, np.ndarray) or a.ndim != 4 or a.dtype != want
                    or not a.flags.c_contiguous or not a.flags.writeable):
                raise ValueError(
                    f"out {name} must be a writeable C-contiguous {np.dtype(want).name} array "
                    f"[layers, kv_heads, tokens, head_dim], got "
                    f"{getattr(a, 'dtype', type(a).__name__)} {np.shape(a)}")
        if K.shape != V.shape:
            raise ValueError(f"out K {K.shape} and V {V.shape} differ")
        layers, heads, tokens, d = K.shape
        if (layer_end not in (0, layer_begin + layers)
                or token_end not in (0, token_begin + tokens)):
            raise ValueError(
                f"out is {K.shape}: layers [{layer_begin}, {layer_begin + layers}) and tokens "
                f"[{token_begin}, {token_begin + tokens}), but layer_end is {layer_end} and "
                f"token_end {token_end}")
        if layers == 0:
            return K, V
        request = pb.FetchRequest(layer_begin=layer_begin, layer_end=layer_begin + layers,
                                  token_begin=token_begin, token_end=token_begin + tokens,
                                  dtype=_wire_dtype(dtype), apply_rope=apply_rope,
                                  max_chunk_bytes=max_chunk_bytes)
        self._ref(sequence_id, request.sequence)

        def run(timeout, _):
            _place_fetch(self._stub.FetchDequant(request, timeout=timeout), K, V, layer_begin,
                         token_begin, progress)

        self._call(run, idempotent=True, deadline=deadline)
        return K, V

    def attend(self, layer, items, softmax_scale=0.0, deadline=None):
        """[(out [num_queries, num_q_heads, head_dim], lse [num_queries,
        num_q_heads])] float32, one per AttendQuery (or (sequence_id, q, ...)
        tuple), in order."""
        request = pb.AttendRequest(layer=layer, softmax_scale=softmax_scale)
        for it in items:
            if not isinstance(it, AttendQuery):
                it = AttendQuery(*it)
            if np.ndim(it.q) != 3:
                raise ValueError(f"q must be [num_queries, num_q_heads, head_dim], got {np.shape(it.q)}")
            item = request.items.add(key_begin=it.key_begin, key_end=it.key_end)
            self._ref(it.sequence_id, item.sequence)
            to_tensor(it.q, out=item.q)
            item.q_positions.extend(it.q_positions or [])
        r = self._call(lambda t, _: self._stub.Attend(request, timeout=t),
                       idempotent=True, deadline=deadline)
        return _results(r)

    def attend_batch(self, layer, sequence_ids, q, softmax_scale=0.0, key_end=0, deadline=None):
        """Attend's packed form, one query per sequence as a batched decode
        step holds them: q [len(sequence_ids), num_q_heads, head_dim] (row i
        for sequence_ids[i]) in one tensor; (out [n, num_q_heads, head_dim],
        lse [n, num_q_heads]) float32 back. Every sequence sees keys [0,
        key_end) (0: all stored); the same results as attend() with one query
        per item."""
        ids = list(sequence_ids)
        if np.ndim(q) != 3 or not ids or np.shape(q)[0] != len(ids):
            raise ValueError(f"q must be [{len(ids)} sequences (at least one), num_q_heads, "
                             f"head_dim], got {np.shape(q)}")
        request = pb.AttendRequest(layer=layer, softmax_scale=softmax_scale)
        for sequence_id in ids:
            self._ref(sequence_id, request.items.add(key_end=key_end).sequence)
        to_tensor(q, out=request.q)
        r = self._call(lambda t, _: self._stub.Attend(request, timeout=t),
                       idempotent=True, deadline=deadline)
        return _packed(r)

    def _append_device(self, sequence_id, k, v, layer_begin, token_ids, deadline, transport):
        request = pb.AppendDeviceRequest()
        self._ref(sequence_id, request.sequence)
        request.layer_begin = layer_begin
        request.dtype = _torch_wire_dtype(k, v)
        request.shape.extend(k.shape)
        request.token_ids.extend(token_ids or [])
        _ipc_payload(k, request.k, "k")
        _ipc_payload(v, request.v, "v")
        r = self._call(lambda t, _: self._stub.AppendDevice(request, timeout=t),
                       idempotent=False, deadline=deadline)
        return AppendResult(num_tokens=r.num_tokens, bytes_stored=r.bytes_stored,
                            wire_bytes=0, chunks=1)

    def fetch_device(self, sequence_id, out_k, out_v, layer_begin=0, token_begin=0,
                     apply_rope=False, deadline=None, transport="cuda_ipc"):
        """fetch's device form: the server writes dequantized K and V into
        out_k and out_v (contiguous CUDA torch tensors [layers, kv_heads,
        tokens, head_dim], float16/float32/bfloat16, whose shape sets the
        range) through CUDA IPC. Never retried."""
        if _check_transport(transport) != "cuda_ipc":
            raise ValueError(f'fetch_device: transport = "{transport}" is not available from '
                             'Python; use "cuda_ipc" (or fetch for "grpc")')
        request = pb.FetchDeviceRequest()
        self._ref(sequence_id, request.sequence)
        request.layer_begin = layer_begin
        request.layer_end = layer_begin + out_k.shape[0]
        request.token_begin = token_begin
        request.token_end = token_begin + out_k.shape[2]
        request.dtype = _torch_wire_dtype(out_k, out_v)
        request.apply_rope = apply_rope
        _ipc_payload(out_k, request.k, "out_k")
        _ipc_payload(out_v, request.v, "out_v")
        self._call(lambda t, _: self._stub.FetchDevice(request, timeout=t),
                   idempotent=False, deadline=deadline)
        return out_k, out_v

    def append_attend(self, layer, items, softmax_scale=0.0, deadline=None):
        """Appends each DecodeItem's k/v to its sequence's layer, then attends;
        [(out, lse)] per item. Never retried."""
        request = pb.AppendAttendRequest()
        self._fill_append_attend(request, layer, items, softmax_scale)
        r = self._call(lambda t, _: self._stub.AppendAttend(request, timeout=t),
                       idempotent=False, deadline=deadline)
        return _results(r)

    def append_attend_batch(self, layer, sequence_ids, k, v, q, softmax_scale=0.0,
                            deadline=None):
        """append_attend's packed form, one new token per sequence: k, v
        [n, kv_heads, head_dim] and q [n, num_q_heads, head_dim], row i for
        sequence_ids[i]; (out [n, num_q_heads, head_dim], lse [n,
        num_q_heads]) float32 back. Never retried."""
        request = pb.AppendAttendRequest()
        self._fill_append_attend_batch(request, layer, sequence_ids, k, v, q, softmax_scale)
        r = self._call(lambda t, _: self._stub.AppendAttend(request, timeout=t),
                       idempotent=False, deadline=deadline)
        return _packed(r)

    def decode_session(self, deadline=None):
        """A DecodeSession; `deadline` (seconds) covers the whole session
        (default: none, it lives as long as the decode loop)."""
        return DecodeSession(self, self._stub, deadline)

    def fork(self, sequence_id, new_sequence_id="", num_tokens=0, ttl_seconds=0, deadline=None):
        """(new sequence id, tokens shared). Never retried."""
        request = pb.ForkRequest(new_sequence_id=new_sequence_id, num_tokens=num_tokens,
                                 ttl_seconds=ttl_seconds)
        self._ref(sequence_id, request.source)
        r = self._call(lambda t, _: self._stub.Fork(request, timeout=t),
                       idempotent=False, deadline=deadline)
        return r.sequence_id, r.num_tokens

    def release(self, sequence_id, deadline=None):
        """Bytes freed (0 when a retry found the sequence already released)."""
        request = pb.ReleaseRequest()
        self._ref(sequence_id, request.sequence)
        self._codebooks.pop(sequence_id, None)
        lost_reply = lambda code: 0 if code == grpc.StatusCode.NOT_FOUND else None
        r = self._call(lambda t, _: self._stub.Release(request, timeout=t),
                       idempotent=True, deadline=deadline, on_retry_status=lost_reply)
        return r if isinstance(r, int) else r.bytes_freed

    def stats(self, sequence_id="", deadline=None):
        """StatsResponse (a kvq.v1 message) of one sequence, or server-wide for ""."""
        request = pb.StatsRequest()
        self._ref(sequence_id, request.sequence)
        return self._call(lambda t, _: self._stub.Stats(request, timeout=t),
                          idempotent=True, deadline=deadline)


_TRANSPORTS = ("grpc", "cuda_ipc", "nccl")


def _check_transport(transport):
    if transport not in _TRANSPORTS:
        raise ValueError(f'transport = "{transport}" must be "grpc", "cuda_ipc" or "nccl"')
    if transport == "nccl":
        raise ValueError('transport = "nccl" is offered by the C++ client (NcclPeer) only; '
                         'use "cuda_ipc" on one node or "grpc"')
    return transport


def _torch_wire_dtype(k, v):
    """The wire dtype of two CUDA torch tensors of one shape and dtype."""
    for name, t in (("k", k), ("v", v)):
        if not getattr(t, "is_cuda", False):
            raise ValueError(f'transport = "cuda_ipc" needs CUDA torch tensors; {name} is '
                             f"{type(t).__name__}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if tuple(k.shape) != tuple(v.shape) or k.dtype != v.dtype or len(k.shape) != 4:
        raise ValueError(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must "
                         "both be [layers, kv_heads, tokens, head_dim] of one dtype")
    names = {"torch.float32": pb.DTYPE_FP32, "torch.float16": pb.DTYPE_FP16,
             "torch.bfloat16": pb.DTYPE_BF16}
    if str(k.dtype) not in names:
        raise ValueError(f"dtype {k.dtype} is not float32, float16 or bfloat16")
    return names[str(k.dtype)]


def _ipc_payload(t, out, name):
    """Fills a DevicePayload with the CUDA IPC handle of tensor t's storage.

    torch exports the storage's whole allocation (the handle) and where the
    storage starts inside it; the tensor's own offset is added."""
    storage = t.untyped_storage()
    shared = storage._share_cuda_()
    device, handle, _, storage_offset = shared[0], shared[1], shared[2], shared[3]
    out.cuda_ipc.handle = bytes(handle)
    out.cuda_ipc.offset = int(storage_offset) + t.storage_offset() * t.element_size()
    out.cuda_ipc.size = t.numel() * t.element_size()
    out.cuda_ipc.device = int(device)
