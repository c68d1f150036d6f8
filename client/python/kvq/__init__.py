"""kvq in Python: quantized KV-cache kernels in-process (kvq._native) and
the client of a kvq server (kvq.client, the `kvq_client` package).

In-process, one layer of one sequence::

    import numpy as np, kvq
    layer = kvq.KvLayer("kivi4:g32:r128", num_kv_heads=8, head_dim=128)
    layer.append(k, v)            # [8, tokens, 128] float32/float16/bfloat16
    k_hat, v_hat = layer.read()   # dequantized float32 [8, tokens, 128]
    out = layer.attend(q)         # fused attention, q [num_q_heads, q_len, 128]

docs/CLIENTS.md describes the API. kvq.hf.KvqCache (imported explicitly: it
needs torch and transformers) is a transformers KV cache backed by kvq
(docs/PYTHON.md).
"""

from ._native import Calibration, KvLayer, page_geometry, quantize_pages, scheme_names

__all__ = ["Calibration", "KvLayer", "client", "page_geometry", "quantize_pages", "scheme_names"]


def __getattr__(name):
    # kvq.client (the gRPC client) is imported on first use: the kernels
    # alone need no grpcio.
    if name == "client":
        import importlib
        return importlib.import_module("kvq.client")
    raise AttributeError(f"module 'kvq' has no attribute {name!r}")
