"""numpy arrays <-> kvq.v1.Tensor, and the chunk planner of prompt appends.

Tensors travel as raw little-endian bytes with an explicit dtype and shape.
numpy has no bfloat16: bf16 goes out from float32 (round to nearest even,
as the C++ kernels round) or from uint16 arrays of bf16 bits (a bfloat16
torch tensor's, as they are), and comes back as float32.
"""

import numpy as np

from . import _proto

pb, _ = _proto.modules()

_NUMPY_TO_WIRE = {
    np.dtype("<f4"): pb.DTYPE_FP32,
    np.dtype("<f2"): pb.DTYPE_FP16,
    np.dtype("<u2"): pb.DTYPE_BF16,  # bf16 bit patterns.
}
_WIRE_NAMES = {"fp32": pb.DTYPE_FP32, "float32": pb.DTYPE_FP32, "fp16": pb.DTYPE_FP16,
               "float16": pb.DTYPE_FP16, "bf16": pb.DTYPE_BF16, "bfloat16": pb.DTYPE_BF16}
_ITEM_BYTES = {pb.DTYPE_FP32: 4, pb.DTYPE_FP16: 2, pb.DTYPE_BF16: 2}


def wire_dtype(name):
    """The wire enum for 'fp32'/'float32', 'fp16'/'float16', 'bf16'/'bfloat16',
    a numpy float32/float16 dtype, or an enum value itself."""
    if isinstance(name, int) and name in _ITEM_BYTES:
        return name
    if isinstance(name, str) and name.lower() in _WIRE_NAMES:
        return _WIRE_NAMES[name.lower()]
    try:
        dt = np.dtype(name).newbyteorder("<")
    except TypeError:
        dt = None
    if dt in _NUMPY_TO_WIRE:
        return _NUMPY_TO_WIRE[dt]
    raise ValueError(f"dtype {name!r} is not float32, float16 or bfloat16")


def float32_to_bf16_bits(x):
    """uint16 bfloat16 bit patterns of float32 values, round to nearest even
    (NaN stays NaN, with its quiet bit set)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = ((u >> 16) | np.uint32(0x40)).astype(np.uint16)
    return np.where(nan, quiet, rounded)


def bf16_bits_to_float32(bits):
    """float32 values of uint16 bfloat16 bit patterns (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def to_tensor(array, dtype=None, out=None):
    """A kvq.v1.Tensor of `array` (float32, float16, or uint16 bf16 bits),
    converted to `dtype` ('fp32', 'fp16', 'bf16'; default: the array's own
    dtype)."""
    a = np.asarray(array)
    bits = a.dtype == np.uint16
    if not bits and (a.dtype.kind != "f" or a.dtype.itemsize not in (2, 4)):
        raise ValueError(f"tensor dtype {a.dtype} is not float32, float16 or bf16 bits (uint16)")
    target = wire_dtype(a.dtype if dtype is None else dtype)
    if bits and target != pb.DTYPE_BF16:
        a, bits = bf16_bits_to_float32(a), False  # Exact in float32.
    if bits:
        data = a.astype("<u2", copy=False)
    elif target == pb.DTYPE_BF16:
        data = float32_to_bf16_bits(a.astype(np.float32, copy=False)).astype("<u2")
    elif target == pb.DTYPE_FP16:
        with np.errstate(over="ignore"):  # Beyond fp16: inf, which the server rejects.
            data = a.astype("<f2", copy=False)
    else:
        data = a.astype("<f4", copy=False)
    t = pb.Tensor() if out is None else out
    t.dtype = target
    del t.shape[:]
    t.shape.extend(int(d) for d in a.shape)
    t.data = np.ascontiguousarray(data).tobytes()
    return t


def from_tensor(tensor, field="tensor"):
    """numpy array of a kvq.v1.Tensor: float32 for fp32 and bf16, float16 for
    fp16. Raises ValueError naming `field` for a bad dtype or byte count."""
    if tensor.dtype not in _ITEM_BYTES:
        raise ValueError(f"{field}.dtype {tensor.dtype} is not fp32, fp16 or bf16")
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"{field}.shape {shape} has a negative dimension")
    count = int(np.prod(shape, dtype=np.int64))
    want = count * _ITEM_BYTES[tensor.dtype]
    if len(tensor.data) != want:
        raise ValueError(f"{field}: shape {shape} needs {want} bytes, has {len(tensor.data)}")
    if tensor.dtype == pb.DTYPE_FP32:
        return np.frombuffer(tensor.data, dtype="<f4").reshape(shape).copy()
    if tensor.dtype == pb.DTYPE_FP16:
        return np.frombuffer(tensor.data, dtype="<f2").reshape(shape).copy()
    return bf16_bits_to_float32(np.frombuffer(tensor.data, dtype="<u2")).reshape(shape)


def prompt_arrays(k, v):
    """(k, v, host_k, host_v) of a prompt's K and V ([layers, kv_heads,
    tokens, head_dim]): k and v for the native quantizer (numpy arrays or
    torch CPU tensors, read in place), host_k and host_v as numpy arrays
    for dense chunks (a bfloat16 tensor's as uint16 bits, no conversion).
    Two dtypes become float32."""
    if hasattr(k, "detach") and hasattr(v, "detach"):  # torch tensors.
        if k.device.type != "cpu" or v.device.type != "cpu":
            raise ValueError(f"k and v must be CPU tensors (transport 'cuda_ipc' takes CUDA "
                             f"ones), got {k.device} and {v.device}")
        k, v = k.detach(), v.detach()
        if k.dtype != v.dtype:
            k, v = k.float(), v.float()
        if str(k.dtype) == "torch.bfloat16":
            import torch
            host_k = k.view(torch.int16).numpy().view(np.uint16)
            host_v = v.view(torch.int16).numpy().view(np.uint16)
        else:
            host_k, host_v = k.numpy(), v.numpy()
    else:
        k, v = np.asarray(k), np.asarray(v)
        if k.dtype != v.dtype:
            k, v = k.astype(np.float32), v.astype(np.float32)
        host_k, host_v = k, v
    if host_k.ndim != 4 or host_k.shape != host_v.shape:
        raise ValueError(f"k {host_k.shape} and v {host_v.shape} must both be "
                         "[layers, kv_heads, tokens, head_dim]")
    return k, v, host_k, host_v


def plan_chunks(layers, tokens, unit_bytes, max_bytes, token_unit=1):
    """Splits layers x tokens into (layer_begin, layers, token_begin, tokens)
    rectangles of at most max_bytes, `token_unit` tokens of one layer
    costing unit_bytes: whole layers per chunk when a layer fits, else one
    layer per chunk split along tokens at multiples of token_unit (never
    less than one unit). Layer-major, each layer's tokens in order (the C++
    client's PlanChunks)."""
    if layers <= 0 or tokens <= 0:
        return []
    token_unit = max(int(token_unit), 1)
    unit_bytes = max(int(unit_bytes), 1)
    max_bytes = max(int(max_bytes), 1)
    layer_bytes = -(-tokens // token_unit) * unit_bytes
    if layer_bytes <= max_bytes:
        per = min(layers, max_bytes // layer_bytes)
        return [(l, min(per, layers - l), 0, tokens) for l in range(0, layers, per)]
    step = max(1, max_bytes // unit_bytes) * token_unit
    return [(l, 1, t, min(step, tokens - t)) for l in range(layers) for t in range(0, tokens, step)]


def assemble_fetch(pieces):
    """Joins FetchDequant pieces [(layer, token_begin, k, v)] with k, v
    [kv_heads, n, head_dim] into (layer_begin, token_begin, K, V) with K, V
    [layers, kv_heads, tokens, head_dim]. ValueError on gaps, overlaps or
    layers that disagree."""
    if not pieces:
        return 0, 0, None, None
    pieces = sorted(pieces, key=lambda p: (p[0], p[1]))
    by_layer = {}
    for layer, begin, k, v in pieces:
        if k.shape != v.shape or k.ndim != 3:
            raise ValueError(f"fetch piece of layer {layer}: k {k.shape} and v {v.shape} "
                             "must both be [kv_heads, tokens, head_dim]")
        by_layer.setdefault(layer, []).append((begin, k, v))
    layers = sorted(by_layer)
    if layers != list(range(layers[0], layers[0] + len(layers))):
        raise ValueError(f"fetched layers {layers} are not contiguous")
    ranges = {}
    for layer in layers:
        begin = by_layer[layer][0][0]
        end = begin
        for b, k, _ in by_layer[layer]:
            if b != end:
                raise ValueError(f"fetch pieces of layer {layer} leave a gap or overlap at {end}")
            end += k.shape[1]
        ranges[layer] = (begin, end)
    first = ranges[layers[0]]
    for layer in layers:
        if ranges[layer] != first:
            raise ValueError(f"layer {layer} covers tokens {ranges[layer]}, layer {layers[0]} {first}")
    K = np.stack([np.concatenate([k for _, k, _ in by_layer[l]], axis=1) for l in layers])
    V = np.stack([np.concatenate([v for _, _, v in by_layer[l]], axis=1) for l in layers])
    return layers[0], first[0], K, V
