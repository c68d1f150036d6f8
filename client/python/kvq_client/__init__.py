"""Python client of kvq, a quantized KV-cache service (see client.py for a
decode-worker example and docs/CLIENTS.md)."""

from .client import (AppendResult, AttendQuery, DecodeItem, DecodeSession, KvqClient, KvqError,
                     MatchResult, ModelLayout, RetryPolicy, RopeParams, SequenceInfo)
from .sharding import ReplicaSet, ShardedClient
from .tensors import (bf16_bits_to_float32, float32_to_bf16_bits, from_tensor, plan_chunks,
                      to_tensor)

__all__ = [
    "AppendResult", "AttendQuery", "DecodeItem", "DecodeSession", "KvqClient", "KvqError",
    "MatchResult", "ModelLayout", "ReplicaSet", "RetryPolicy", "RopeParams", "SequenceInfo",
    "ShardedClient",
    "bf16_bits_to_float32", "float32_to_bf16_bits", "from_tensor", "plan_chunks", "to_tensor",
]
