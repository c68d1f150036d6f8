"""The model shape of tests/python/data/vllm_trace.json (Qwen2.5-0.5B's
attention: 24 layers, 14 query heads, 2 KV heads of 64) and the KV values the
replay test's stand-in forward pass writes."""

import os

import numpy as np

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 24, 14, 2, 64
BLOCK_SIZE = 16
NUM_BLOCKS = 64
PREEMPT_BLOCKS = 22  # engine-c: 21 usable blocks, two 150-token prompts decoding.
SCHEME = os.environ.get("KVQ_TRACE_SCHEME", "kivi4:g32:r128")

MODEL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": LAYERS, "num_attention_heads": Q_HEADS,
    "num_key_value_heads": KV_HEADS, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "vocab_size": 151936, "torch_dtype": "bfloat16",
    "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 151643,
    "eos_token_id": 151645, "sliding_window": None, "use_sliding_window": False,
    "max_window_layers": 21,
}

# Calls the recorder logs (one list, whichever module path imported the
# recording connector).
EVENTS = []


def layer_names():
    return [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def token_kv(layer, positions, token_ids):
    """K and V [kv_heads, len(positions), head_dim] float32 a model would
    compute for these tokens: a function of (layer, position, token id), so
    two engines given the same prompt prefix hold the same values."""
    positions = np.asarray(positions, np.int64)
    token_ids = np.asarray(token_ids, np.int64)
    h = np.arange(KV_HEADS, dtype=np.int64)[:, None, None]
    d = np.arange(HEAD_DIM, dtype=np.int64)[None, None, :]
    seed = (token_ids * 7919 + positions * 104729 + layer * 15485863)[None, :, None]
    x = ((seed + h * 31 + d * 17) % 1009).astype(np.float32) / 1009.0 * 4.0 - 2.0
    return x, -0.5 * x + 0.25


class PagedCache:
    """One engine's paged KV cache as vLLM (0.33, 0.34) hands it to a connector: per
    layer the view [blocks, kv_heads, block_size, 2 * head_dim] (key in the
    first half of the last dim) over a token-major allocation [blocks,
    block_size, kv_heads, 2 * head_dim] (vLLM's LBNHC layout), so the view is
    not contiguous, as on a GPU."""

    def __init__(self, dtype, num_blocks=NUM_BLOCKS):
        import torch
        self.views = {}
        for name in layer_names():
            raw = torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, 2 * HEAD_DIM, dtype=dtype)
            self.views[name] = raw.permute(0, 2, 1, 3)

    def forward_layer(self, layer, name, slots, positions, token_ids):
        """What the attention layer does before save_kv_layer: writes this
        step's K and V into their slots."""
        import torch
        if not slots:
            return
        k, v = token_kv(layer, positions, token_ids)
        view = self.views[name]
        slots = torch.as_tensor(slots, dtype=torch.int64)
        rows = torch.from_numpy(np.concatenate([k, v], axis=-1)).transpose(0, 1)
        view[slots // BLOCK_SIZE, :, slots % BLOCK_SIZE] = rows.to(view.dtype)

    def read(self, name, slots):
        """(k, v) float32 [kv_heads, len(slots), head_dim] at these slots."""
        import torch
        slots = torch.as_tensor(slots, dtype=torch.int64)
        rows = self.views[name][slots // BLOCK_SIZE, :, slots % BLOCK_SIZE].transpose(0, 1)
        rows = rows.float().numpy()
        return rows[..., :HEAD_DIM], rows[..., HEAD_DIM:]


def run_worker_event(connector, cache, meta, event, forward):
    """Makes one worker-side call of the trace on `connector`. `forward` is
    the step's {"slot_mapping", "positions", "token_ids"}. Returns the call's
    result."""
    call = event["call"]
    if call == "handle_preemptions":
        return connector.handle_preemptions(meta)
    if call == "bind_connector_metadata":
        return connector.bind_connector_metadata(meta)
    if call == "start_load_kv":
        # vLLM passes its ForwardContext; KvqConnector reads nothing from it.
        return connector.start_load_kv(None)
    if call == "wait_for_layer_load":
        return connector.wait_for_layer_load(event["layer_name"])
    if call == "save_kv_layer":
        name = event["layer_name"]
        cache.forward_layer(layer_names().index(name), name, forward["slot_mapping"],
                            forward["positions"], forward["token_ids"])
        # vLLM passes the layer's AttentionMetadata; KvqConnector reads nothing from it.
        return connector.save_kv_layer(name, cache.views[name], None)
    if call == "wait_for_save":
        return connector.wait_for_save()
    if call == "get_finished":
        return connector.get_finished(set(event["finished_req_ids"]))
    if call == "get_block_ids_with_load_errors":
        return connector.get_block_ids_with_load_errors()
    if call == "clear_connector_metadata":
        return connector.clear_connector_metadata()
    raise ValueError(f"unknown worker call {call!r}")
