"""Reading and writing a request's tokens in vLLM's paged KV cache (torch).

vLLM (0.33) hands a connector each attention layer's cache as the
standardized per-layer view [B, H, N, C] (RFC #42082): B kernel blocks, H KV
heads, N tokens per kernel block, C = 2 * head_size with the key in
[..., :head_size] and the value in [..., head_size:] (how the FlashAttention,
Triton and FlexAttention backends split it). The view's physical strides
depend on the layout vLLM picked; indexing the view hides them.

A scheduler block of `block_size` tokens may span several kernel blocks of N
tokens (vLLM's virtual block splitting): scheduler block b is kernel blocks
[b * block_size / N, (b + 1) * block_size / N).
"""

from typing import List, Tuple

import torch


def slot_indices(block_ids: List[int], block_size: int, kernel_block_tokens: int, begin: int,
                 end: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(kernel block, offset in it) of each position in [begin, end)."""
    if block_size % kernel_block_tokens != 0:
        raise ValueError(f"block_size {block_size} is not a multiple of the cache's "
                         f"{kernel_block_tokens} tokens per kernel block")
    needed = -(-end // block_size) if end > 0 else 0
    if needed > len(block_ids):
        raise ValueError(f"tokens [{begin}, {end}) need {needed} blocks of {block_size}, "
                         f"the request has {len(block_ids)}")
    pos = torch.arange(begin, end, dtype=torch.int64)
    blocks = torch.as_tensor(block_ids, dtype=torch.int64)[pos // block_size]
    per_block = block_size // kernel_block_tokens
    kernel_block = blocks * per_block + (pos % block_size) // kernel_block_tokens
    return kernel_block, pos % kernel_block_tokens


def check_layer_view(kv_layer: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """ValueError unless `kv_layer` is a [B, num_kv_heads, N, 2 * head_dim] view."""
    if (kv_layer.dim() != 4 or kv_layer.shape[1] != num_kv_heads
            or kv_layer.shape[3] != 2 * head_dim):
        raise ValueError(f"expected vLLM's per-layer KV view [blocks, {num_kv_heads} kv heads, "
                         f"block tokens, {2 * head_dim}], got {tuple(kv_layer.shape)} (MLA and "
                         "other cache layouts are not supported)")


def gather(kv_layer: torch.Tensor, kernel_block: torch.Tensor,
           offset: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(k, v) of the given slots, each [kv_heads, tokens, head_dim] on the
    cache's device."""
    rows = kv_layer[kernel_block.to(kv_layer.device), :, offset.to(kv_layer.device)]
    d = kv_layer.shape[3] // 2
    rows = rows.transpose(0, 1)  # [tokens, heads, 2d] -> [heads, tokens, 2d]
    return rows[..., :d], rows[..., d:]


def scatter(kv_layer: torch.Tensor, kernel_block: torch.Tensor, offset: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes k, v ([kv_heads, tokens, head_dim]) into the given slots."""
    rows = torch.cat([k, v], dim=-1).transpose(0, 1).to(device=kv_layer.device,
                                                         dtype=kv_layer.dtype)
    kv_layer[kernel_block.to(kv_layer.device), :, offset.to(kv_layer.device)] = rows
