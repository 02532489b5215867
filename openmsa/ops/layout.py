"""Conversions between the public layouts and the packed, token-major layouts of the kernels."""

from __future__ import annotations

import torch


def packed_tokens(tensor: torch.Tensor) -> torch.Tensor:
    """``[B, S, heads, dim]`` or ``[T, heads, dim]`` -> ``[tokens, heads, dim]`` with a unit
    stride in the last dim (a view when the input allows one)."""
    flat = tensor.reshape(-1, *tensor.shape[-2:])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def batch_cu_seqlens(batch: int, seqlen: int, device) -> torch.Tensor:
    """Offsets of ``batch`` rows of ``seqlen`` tokens viewed as packed sequences: int32 [B + 1]."""
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def packed_offsets(cu_seqlens, batch: int, seqlen: int, device) -> torch.Tensor:
    """``cu_seqlens`` (contiguous: the kernels read it through a raw pointer), or the offsets
    of ``batch`` rows of ``seqlen`` tokens."""
    if cu_seqlens is not None:
        return cu_seqlens.contiguous()
    return batch_cu_seqlens(batch, seqlen, device)


def ids_to_token_major(block_ids: torch.Tensor, packed: bool) -> torch.Tensor:
    """SPEC layout (``[B, Hi, S, k]`` or packed ``[Hi, T, k]``) -> int32 ``[tokens, Hi, k]``."""
    if packed:
        token_major = block_ids.permute(1, 0, 2)
    else:
        batch, heads, seqlen, slots = block_ids.shape
        token_major = block_ids.permute(0, 2, 1, 3).reshape(batch * seqlen, heads, slots)
    return token_major.to(torch.int32).contiguous()


def ids_from_token_major(token_major: torch.Tensor, packed: bool, batch: int,
                         seqlen: int) -> torch.Tensor:
    """int32 ``[tokens, Hi, k]`` -> the SPEC layout (a view)."""
    if packed:
        return token_major.permute(1, 0, 2)
    return token_major.view(batch, seqlen, *token_major.shape[1:]).permute(0, 2, 1, 3)


def all_causal_block_ids(query_positions: torch.Tensor, num_index_heads: int, block_size: int,
                         max_seqlen: int) -> torch.Tensor:
    """Warmup's "selection": every block up to the query's own, int32 ``[Tq, Hi, nb]`` with
    ``nb = ceil(max_seqlen / block_size)`` (later slots -1), built without host sync.
    ``query_positions``: int64 ``[Tq]``, each query's position in its sequence."""
    num_blocks = -(-max_seqlen // block_size)
    own = query_positions // block_size  # [Tq]
    blocks = torch.arange(num_blocks, device=query_positions.device)
    ids = torch.where(blocks[None, :] <= own[:, None], blocks[None, :], -1).to(torch.int32)
    return ids[:, None, :].expand(own.shape[0], num_index_heads, num_blocks).contiguous()
