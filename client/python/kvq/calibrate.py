"""The crq schemes' calibration from any transformers model.

What ``kvq-eval --write_calibration`` computes with kvq's C++ forward pass
(bench/eval/calibration_stats.cc; docs/QUALITY.md derives it), from the
model's own forward pass: run the calibration text through the model, and
per layer and KV head take

- the channel means of the pre-RoPE keys (after any QK-norm: the keys as
  the attention receives them, with RoPE undone) and of the values;
- key scales per RoPE pair (c, c + head_dim / 2, transformers' half-split
  pairs): s = (K / Q)^(1/4), K the pair's summed key variance and Q the
  pair's summed mean squared query of the group's query heads, normalized
  to geometric mean 1;
- value scales per channel: s = (value variance / |W_o columns|^2)^(1/4),
  the squared norms of the output-projection columns the channel feeds
  (over the group's query heads), normalized to geometric mean 1.

The statistics are collected by an attention function ("kvq_calibrate")
that records the query, key and value each layer attends with and then
attends with sdpa, so QK-norm, per-layer RoPE and sliding windows are the
model's own. The result is a ``kvq.Calibration`` (checked and written by
kvq's C++ file code: ``.write(path)``)::

    from kvq.calibrate import calibrate
    cal = calibrate(model, token_ids, name="gemma3-270m")
    cal.write("gemma3-270m.kvqcal")
    layer = kvq.KvLayer("crq3:r16:pre_rope", 1, 256, rope_theta=10000.0,
                        calibration=cal, calibration_layer=0)

Needs torch and transformers, as kvq.hf does.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import numpy as np
import torch

from . import _native

__all__ = ["calibrate", "key_scales", "layer_rope_theta", "value_scales"]

ATTENTION = "kvq_calibrate"
_state = threading.local()


def layer_rope_theta(config, layer: int) -> Optional[float]:
    """The RoPE base of decoder layer `layer`: models with per-layer-type
    RoPE (Gemma 3: sliding and full attention) keep one rope_parameters
    entry per layer type."""
    c = config.get_text_config(decoder=True)
    rope = getattr(c, "rope_parameters", None) or {}
    types = getattr(c, "layer_types", None)
    if types and isinstance(rope.get(types[layer]), dict):
        rope = rope[types[layer]]
    theta = rope.get("rope_theta", getattr(c, "rope_theta", None))
    return None if theta is None else float(theta)


def _floored(x: np.ndarray) -> np.ndarray:
    """Zero (or rounding-negative) moments raised to 1e-6 of their mean, so
    a dead channel gets a finite scale (calibration_stats.cc Floored)."""
    x = np.asarray(x, np.float64)
    mean = np.maximum(x, 0.0).mean() if x.size else 0.0
    return np.maximum(x, 1e-6 * mean if mean > 0 else 1e-30)


def _quartic_root_scales(num: np.ndarray, den: np.ndarray, group_of: np.ndarray) -> np.ndarray:
    """s[c] = (sum num / sum den over c's group)^(1/4), geometric mean 1."""
    groups = int(group_of.max()) + 1
    gn = np.bincount(group_of, weights=_floored(num), minlength=groups)
    gd = np.bincount(group_of, weights=_floored(den), minlength=groups)
    log_s = 0.25 * (np.log(gn) - np.log(gd))[group_of]
    return np.exp(log_s - log_s.mean()).astype(np.float32)


def key_scales(key_var: np.ndarray, query_sq: np.ndarray) -> np.ndarray:
    """Key scales of one head, equal on each half-split RoPE pair (c, c + d/2)."""
    d = len(key_var)
    return _quartic_root_scales(key_var, query_sq, np.arange(d) % (d // 2))


def value_scales(value_var: np.ndarray, out_sq: np.ndarray) -> np.ndarray:
    """Value scales of one head, one per channel."""
    return _quartic_root_scales(value_var, out_sq, np.arange(len(value_var)))


class _Stats:
    """First and second moments per (layer, KV head) of what the attention
    of each layer receives."""

    def __init__(self, config):
        from .hf import _InverseRope, model_geometry

        g = model_geometry(config)
        self.geometry = g
        L, H, D = g["num_layers"], g["num_kv_heads"], g["head_dim"]
        self.sums = {k: np.zeros((L, H, D)) for k in ("k", "k2", "v", "v2", "q2")}
        self.tokens = np.zeros(L, np.int64)
        self.inverse = []
        for layer in range(L):
            theta = layer_rope_theta(config, layer)
            self.inverse.append(None if theta is None else _InverseRope(theta, D))
        self.start = 0  # Position of the chunk's first token.

    def add(self, layer: int, query, key, value) -> None:
        """query [1, q_heads, n, d], key/value [1, kv_heads, >= n, d]
        post-RoPE: the chunk's tokens are the last n."""
        n = query.shape[2]
        k = key[0, :, -n:].detach().to(torch.float32)
        if self.inverse[layer] is not None:
            k = self.inverse[layer](k, self.start)
        k = k.double().numpy()
        v = value[0, :, -n:].detach().double().numpy()
        q = query[0].detach().double().numpy()
        h = k.shape[0]
        q2 = (q ** 2).reshape(h, q.shape[0] // h, n, -1).sum(axis=(1, 2)) / (q.shape[0] // h)
        s = self.sums
        s["k"][layer] += k.sum(axis=1)
        s["k2"][layer] += (k ** 2).sum(axis=1)
        s["v"][layer] += v.sum(axis=1)
        s["v2"][layer] += (v ** 2).sum(axis=1)
        s["q2"][layer] += q2
        self.tokens[layer] += n


def _calibrate_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _state.stats.add(module.layer_idx, query, key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _calibrate_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def _out_sq(model, geometry: dict) -> list:
    """Per layer: the squared norm of each output-projection column ([q_heads
    * head_dim]; o_proj.weight is [hidden, q_heads * head_dim])."""
    layers = [m for m in model.modules() if hasattr(m, "o_proj") and hasattr(m, "layer_idx")]
    out = [None] * geometry["num_layers"]
    for m in layers:
        w = m.o_proj.weight.detach().double()
        out[m.layer_idx] = (w ** 2).sum(dim=0).numpy()
    missing = [i for i, x in enumerate(out) if x is None]
    if missing:
        raise ValueError(f"calibrate: no attention module with an o_proj for layers {missing}")
    return out


def calibrate(model, token_ids: Sequence[int], name: str, *, chunk: int = 512,
              model_name: str = "") -> "_native.Calibration":
    """The calibration named `name` of `model` (a transformers causal LM)
    from `token_ids` (the calibration text's, never an evaluation corpus's),
    run in `chunk`-token steps of chunked prefill. `model_name` is what the
    file records as its model (informative)."""
    from transformers import DynamicCache

    tokens = [int(t) for t in token_ids]
    if not tokens:
        raise ValueError("calibrate: no calibration tokens")
    stats = _Stats(model.config)
    g = stats.geometry
    previous = model.config._attn_implementation
    _register()
    model.set_attn_implementation(ATTENTION)
    _state.stats = stats
    try:
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            for pos in range(0, len(tokens), chunk):
                stats.start = pos
                ids = torch.tensor([tokens[pos:pos + chunk]], dtype=torch.long)
                model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        _state.stats = None
        model.set_attn_implementation(previous)
    if (stats.tokens == 0).any():
        raise ValueError(f"calibrate: layers {np.flatnonzero(stats.tokens == 0).tolist()} saw "
                         "no tokens")
    L, H, D = g["num_layers"], g["num_kv_heads"], g["head_dim"]
    group = g["num_q_heads"] // H
    out_sq = _out_sq(model, g)
    arrays = {k: np.zeros((L, H, D), np.float32)
              for k in ("key_mean", "key_scale", "value_mean", "value_scale")}
    s = stats.sums
    for layer in range(L):
        n = float(stats.tokens[layer])
        for h in range(H):
            mk, mv = s["k"][layer, h] / n, s["v"][layer, h] / n
            arrays["key_mean"][layer, h] = mk
            arrays["value_mean"][layer, h] = mv
            query_sq = s["q2"][layer, h] / n
            w_sq = out_sq[layer].reshape(-1, D)[h * group:(h + 1) * group].sum(axis=0)
            arrays["key_scale"][layer, h] = key_scales(s["k2"][layer, h] / n - mk * mk, query_sq)
            arrays["value_scale"][layer, h] = value_scales(s["v2"][layer, h] / n - mv * mv, w_sq)
    fingerprint = (f"{model_name} layers={L} kv_heads={H} q_heads={g['num_q_heads']} "
                   f"head_dim={D} rope=half_split").strip()
    return _native.Calibration.from_arrays(name, arrays["key_mean"], arrays["key_scale"],
                                           arrays["value_mean"], arrays["value_scale"],
                                           model=fingerprint)
