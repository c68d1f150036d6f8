"""A Hugging Face transformers KV cache backed by kvq.

``KvqCache`` stores every attention layer's keys and values in a kvq scheme,
either in this process (one ``kvq.KvLayer`` per layer and batch row) or on a
kvq server (one sequence per batch row, through ``kvq_client``)::

    from kvq.hf import KvqCache, use_kvq_attention
    use_kvq_attention(model)       # attention by kvq's fused kernels
    cache = KvqCache(model.config, "kivi4:pre_rope:sink=4")
    out = model.generate(input_ids, cache=cache, max_new_tokens=64)
    cache.bytes_by_component()     # what the stored K/V take, by component

    remote = KvqCache(model.config, "kivi4", client=kvq_client.KvqClient("host:port"))

Two ways to attend (docs/PYTHON.md compares them):

- fused (the model's attention implementation is "kvq", set by
  ``use_kvq_attention``): ``update`` only appends, and kvq's fused attention
  (``KvLayer.attend``, or the server's Attend RPC) reads the stored codes
  directly. Nothing dequantized is kept: the cache takes what kvq stores.
  Causal self-attention of unpadded rows, as decoder LMs run it.
- dequantized (any other attention implementation: sdpa, eager, ...):
  ``update`` appends and returns the whole layer's dequantized K/V. A float
  copy of them is kept, refreshed only from the first token kvq may still
  change (tokens kvq has quantized never change), so decode reads O(tail)
  per step; the copy costs what a DynamicCache costs.

Keys arrive after RoPE. A ``pre_rope`` scheme stores keys before RoPE and
rotates them itself in attention and reads, so the cache undoes the model's
rotation first; it does so only for the plain RoPE kvq applies (half-split
pairs, no scaling) and refuses other rope types with a ValueError.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _native

__all__ = ["KvqCache", "KvqCacheLayer", "model_geometry", "use_kvq_attention"]

ATTENTION = "kvq"  # The attention implementation name registered with transformers.


def model_geometry(config) -> dict:
    """num_layers, num_kv_heads, num_q_heads, head_dim, rope_theta and
    rope_type of a transformers decoder config."""
    c = config.get_text_config(decoder=True)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    rope = getattr(c, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    return {
        "num_layers": c.num_hidden_layers,
        "num_kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "num_q_heads": heads,
        "head_dim": head_dim,
        "rope_theta": None if theta is None else float(theta),
        "rope_type": rope.get("rope_type", "default"),
        "partial_rotary_factor": float(getattr(c, "partial_rotary_factor", 1.0) or 1.0),
    }


def _is_pre_rope(scheme: str) -> bool:
    return "pre_rope" in scheme.split(":")[1:]


class _InverseRope:
    """Undoes transformers' default RoPE (half-split pairs: channel i with
    i + head_dim/2, angle position * theta^(-2i/head_dim))."""

    def __init__(self, theta: float, head_dim: int):
        exponent = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
        self.inv_freq = 1.0 / (theta ** exponent)

    def __call__(self, k: torch.Tensor, start: int) -> torch.Tensor:
        """k [heads, n, head_dim] float32 post-RoPE at positions start.."""
        n = k.shape[1]
        angles = np.outer(np.arange(start, start + n, dtype=np.float64), self.inv_freq)
        angles = np.concatenate([angles, angles], axis=1)
        cos = torch.from_numpy(np.cos(angles).astype(np.float32))
        sin = torch.from_numpy(np.sin(angles).astype(np.float32))
        half = k.shape[-1] // 2
        rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
        # R(-a) = R(a)^T: k cos - rotate_half(k) sin.
        return k * cos - rotated * sin


class _LocalStore:
    """One batch row of one layer in this process: a kvq.KvLayer."""

    def __init__(self, scheme: str, geometry: dict, backend: str, codebooks):
        kwargs = {"backend": backend}
        if geometry["rope_theta"] is not None:
            kwargs["rope_theta"] = geometry["rope_theta"]
        if codebooks is not None:
            kwargs["codebooks"] = codebooks
        self.layer = _native.KvLayer(scheme, geometry["num_kv_heads"], geometry["head_dim"],
                                     **kwargs)

    @property
    def num_tokens(self) -> int:
        return self.layer.num_tokens

    def stable_tokens(self) -> int:
        # Sink and quantized tokens are final; the fp16 tail is requantized
        # when it fills.
        return self.layer.sink_tokens + self.layer.quantized_tokens

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        self.layer.append(k, v)

    def read(self, begin: int, end: int):
        return self.layer.read(begin, end)

    def attend(self, q: np.ndarray, scale: Optional[float]) -> np.ndarray:
        """q [num_q_heads, n, head_dim] float32: the last n stored tokens'
        queries, causal; out the same shape."""
        return self.layer.attend(q, scale=scale)

    def bytes_by_component(self) -> dict:
        return dict(self.layer.bytes_by_component())

    def release(self) -> None:
        pass


class _RemoteSequence:
    """One batch row on a kvq server: one sequence holding every layer."""

    def __init__(self, client, scheme: str, geometry: dict, codebooks):
        from kvq_client import ModelLayout, RopeParams

        rope = RopeParams(theta=geometry["rope_theta"] or 10000.0, pairing="half_split")
        layout = ModelLayout(geometry["num_layers"], geometry["num_kv_heads"],
                             geometry["num_q_heads"], geometry["head_dim"], rope)
        self.client = client
        self.tokens = [0] * geometry["num_layers"]
        self.sequence_id = client.create_sequence(layout, scheme=scheme,
                                                  codebooks=codebooks).sequence_id
        self.pre_rope = _is_pre_rope(scheme)

    def release(self) -> None:
        if self.sequence_id is not None:
            self.client.release(self.sequence_id)
            self.sequence_id = None


class _RemoteStore:
    """One layer of a _RemoteSequence: Append and FetchDequant of that layer."""

    def __init__(self, sequence: _RemoteSequence, layer: int):
        self.sequence = sequence
        self.layer = layer

    @property
    def num_tokens(self) -> int:
        return self.sequence.tokens[self.layer]

    def stable_tokens(self) -> int:
        return 0  # The server's split into sink, quantized and tail is not exposed.

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        s = self.sequence
        # Dense fp32, quantized by the server: client-side pages assume every
        # layer at the same length, which a layer-by-layer step breaks.
        s.client.append_prompt(s.sequence_id, k[None], v[None], layer_begin=self.layer,
                               quantize=False)
        s.tokens[self.layer] += k.shape[1]

    def read(self, begin: int, end: int):
        s = self.sequence
        k, v = s.client.fetch(s.sequence_id, layer_begin=self.layer, layer_end=self.layer + 1,
                              token_begin=begin, token_end=end, dtype="fp32",
                              apply_rope=s.pre_rope)
        return k[0], v[0]

    def attend(self, q: np.ndarray, scale: Optional[float]) -> np.ndarray:
        from kvq_client import AttendQuery

        s = self.sequence
        n = q.shape[1]
        end = s.tokens[self.layer]
        query = AttendQuery(s.sequence_id, np.ascontiguousarray(q.transpose(1, 0, 2)),
                            q_positions=list(range(end - n, end)), key_end=end)
        out, _ = s.client.attend(self.layer, [query], softmax_scale=scale or 0.0)[0]
        return np.asarray(out, np.float32).reshape(n, q.shape[0], q.shape[2]).transpose(1, 0, 2)

    def bytes_by_component(self) -> dict:
        return {}  # KvqCache.bytes_by_component asks the server.

    def release(self) -> None:
        pass  # The sequence is released once, by KvqCache.release.


class KvqCacheLayer(CacheLayerMixin):
    """One attention layer: a kvq store per batch row, and the dequantized
    K/V of every stored token as tensors ([batch, kv_heads, tokens,
    head_dim], the dtype the model gave), refreshed from the first token kvq
    may still change."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, make_store, inverse_rope: Optional[_InverseRope], fused):
        super().__init__()
        self._make_store = make_store
        self._fused = fused
        self._inverse_rope = inverse_rope
        self.stores: list = []
        self.cumulative_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.stores = [self._make_store(b) for b in range(key_states.shape[0])]
        shape = (key_states.shape[0], key_states.shape[1], 0, key_states.shape[3])
        self.keys = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.values = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def _grow(self, tokens: int) -> None:
        capacity = self.keys.shape[2]
        if tokens <= capacity:
            return
        new = max(tokens, 2 * capacity, 64)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = torch.empty(old.shape[:2] + (new,) + old.shape[3:], dtype=old.dtype,
                                device=old.device)
            grown[:, :, :capacity] = old
            setattr(self, name, grown)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != len(self.stores):
            raise ValueError(f"batch of {key_states.shape[0]} rows, the cache was started "
                             f"with {len(self.stores)}")
        fused = self._fused()
        n = key_states.shape[2]
        start = self.cumulative_length
        if not fused:
            self._grow(start + n)
        for b, store in enumerate(self.stores):
            k = key_states[b].detach().to("cpu", torch.float32)
            if self._inverse_rope is not None:
                k = self._inverse_rope(k, start)
            v = value_states[b].detach().to("cpu", torch.float32)
            stable = store.stable_tokens()
            store.append(k.contiguous().numpy(), v.contiguous().numpy())
            if fused:
                continue
            k_hat, v_hat = store.read(stable, start + n)
            self.keys[b, :, stable:start + n] = torch.from_numpy(np.asarray(k_hat)).to(
                self.device, self.dtype)
            self.values[b, :, stable:start + n] = torch.from_numpy(np.asarray(v_hat)).to(
                self.device, self.dtype)
        self.cumulative_length = start + n
        if fused:
            # The "kvq" attention function of this layer attends next.
            _pending.layer = self
            return key_states, value_states
        return self.keys[:, :, :start + n], self.values[:, :, :start + n]

    def attend(self, query: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
        """Fused attention of query [batch, num_q_heads, n, head_dim] (the
        last n stored tokens' queries, causal); [batch, n, num_q_heads,
        head_dim] back, as transformers' attention functions return it."""
        outs = []
        for b, store in enumerate(self.stores):
            q = query[b].detach().to("cpu", torch.float32).contiguous().numpy()
            outs.append(torch.from_numpy(np.asarray(store.attend(q, scale))))
        return torch.stack(outs).transpose(1, 2).to(query.device, query.dtype)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for store in self.stores:
            store.release()
        self.stores = []
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KvqCache does not reorder beams: kvq stores one sequence "
                                  "per batch row")

    def bytes_by_component(self) -> dict:
        total: dict = {}
        for store in self.stores:
            for name, b in store.bytes_by_component().items():
                total[name] = total.get(name, 0) + b
        return total


class KvqCache(Cache):
    """A transformers Cache whose layers store K/V in a kvq scheme.

    config: the model's config (its decoder's layer count, heads, head_dim
    and RoPE). scheme: a kvq scheme string ("fp16", "int8", "kivi4",
    "kivi4:pre_rope:sink=4", ...). client: a kvq_client.KvqClient to keep
    the K/V on a kvq server instead of in this process; backend: the
    in-process kernel backend. codebooks (nuq schemes): per layer, a list
    of (key_levels, value_levels) per KV head.
    """

    def __init__(self, config, scheme: str = "kivi4", *, client=None, backend: str = "cpu",
                 codebooks: Optional[Sequence[Sequence[Any]]] = None):
        geometry = model_geometry(config)
        text = config.get_text_config(decoder=True)
        layer_types = getattr(text, "layer_types", None) or ["full_attention"]
        others = sorted(set(layer_types) - {"full_attention"})
        if others:
            raise ValueError(f"KvqCache holds full-attention layers only; this model has {others}")
        inverse = None
        if _is_pre_rope(scheme):
            if (geometry["rope_theta"] is None or geometry["rope_type"] != "default"
                    or geometry["partial_rotary_factor"] != 1.0):
                raise ValueError(
                    f'scheme "{scheme}" stores keys before RoPE and kvq then applies plain RoPE '
                    f'(half-split pairs, no scaling); this model\'s RoPE is rope_type '
                    f'"{geometry["rope_type"]}" with partial_rotary_factor '
                    f'{geometry["partial_rotary_factor"]}: use a scheme without pre_rope')
            inverse = _InverseRope(geometry["rope_theta"], geometry["head_dim"])
        if codebooks is not None and len(codebooks) != geometry["num_layers"]:
            raise ValueError(f"codebooks: one list per layer ({geometry['num_layers']}), "
                             f"got {len(codebooks)}")
        self.scheme = scheme
        self.geometry = geometry
        self.client = client
        self._sequences: list = []
        layers = []
        for i in range(geometry["num_layers"]):
            layer_codebooks = None if codebooks is None else codebooks[i]
            if client is None:
                def make(b, cb=layer_codebooks):
                    return _LocalStore(scheme, geometry, backend, cb)
            else:
                def make(b, i=i):
                    while len(self._sequences) <= b:
                        self._sequences.append(_RemoteSequence(
                            client, scheme, geometry,
                            None if codebooks is None else [c for cbs in codebooks for c in cbs]))
                    return _RemoteStore(self._sequences[b], i)
            layers.append(KvqCacheLayer(make, inverse, self.fused))
        super().__init__(layers=layers)
        self._config = config

    def fused(self) -> bool:
        """Whether attention is kvq's fused kernel (the model's attention
        implementation is "kvq") rather than the model's own over
        dequantized K/V."""
        return getattr(self._config, "_attn_implementation", None) == ATTENTION

    @property
    def sequence_ids(self) -> list:
        """The server's sequence ids, one per batch row (remote caches)."""
        return [s.sequence_id for s in self._sequences]

    def bytes_by_component(self) -> dict:
        """Allocated bytes of every layer's K/V by component (codes, scales,
        outliers, residual, sink, codebook, padding, total). Remote: from the
        server's Stats of each sequence."""
        if self.client is not None:
            out = {}
            for s in self._sequences:
                if s.sequence_id is None:
                    continue
                b = self.client.stats(s.sequence_id).bytes
                for field, value in b.ListFields():
                    out[field.name] = out.get(field.name, 0) + value
            return out
        out: dict = {}
        for layer in self.layers:
            for name, b in layer.bytes_by_component().items():
                out[name] = out.get(name, 0) + b
        return out

    def release(self) -> None:
        """Frees the K/V (the server's sequences, for a remote cache)."""
        for layer in self.layers:
            layer.reset()
        for s in self._sequences:
            s.release()
        self._sequences = []

    def __enter__(self) -> "KvqCache":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ----------------------------------------------------------- fused attention

# The layer whose update() ran last on this thread: transformers calls a
# layer's attention function right after its cache update, and does not pass
# the cache to it.
_pending = threading.local()


def _kvq_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                   **kwargs):
    """transformers attention function "kvq": kvq's fused attention over
    what the KvqCache layer stores (key and value are already in it)."""
    layer = getattr(_pending, "layer", None)
    _pending.layer = None
    if layer is None:
        raise ValueError('attn_implementation "kvq" attends over a KvqCache: pass '
                         "cache=KvqCache(model.config, scheme)")
    if dropout:
        raise ValueError('attn_implementation "kvq" is for inference: dropout must be 0')
    return layer.attend(query, scaling), None


def _kvq_mask(batch_size, q_length=None, kv_length=None, *args, attention_mask=None, **kwargs):
    """The mask function of "kvq": none (kvq's attention is causal over the
    row's own tokens); padded rows are refused."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError('attn_implementation "kvq" attends causally over each row\'s own '
                         "tokens: padded batches need the model's own attention "
                         "(KvqCache then returns dequantized K/V)")
    return None


def use_kvq_attention(model) -> None:
    """Registers the "kvq" attention function with transformers and makes it
    `model`'s: a KvqCache then attends with kvq's fused kernels."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _kvq_attention)
    AttentionMaskInterface.register(ATTENTION, _kvq_mask)
    model.set_attn_implementation(ATTENTION)
