"""Work lists built on the device (no host synchronization) for kernels over packed sequences."""

from __future__ import annotations

import torch


def batch_cu_seqlens(batch: int, seqlen: int, device) -> torch.Tensor:
    """Offsets of ``batch`` rows of ``seqlen`` tokens viewed as packed sequences: int32 [B + 1]."""
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def query_tile_entries(total_tokens: int, num_sequences: int, tile_tokens: int) -> int:
    """Entries of ``query_tile_schedule``'s list: an upper bound on the tile count known from
    shapes alone (each sequence adds at most one partial tile)."""
    return total_tokens // tile_tokens + num_sequences


def query_tile_schedule(cu_seqlens: torch.Tensor, total_tokens: int, tile_tokens: int):
    """One entry per query tile of ``tile_tokens`` tokens of every sequence, most work first.

    Tiles start at each sequence's first token. Causal work grows with a tile's position, so tiles
    are ordered by descending position: the long ones start first and the short ones fill the
    gaps. The grid size must be known on the host without reading ``cu_seqlens``, so the list has
    ``total_tokens // tile_tokens + num_sequences`` entries (an upper bound on the tile count);
    entries past the real tiles hold sequence -1.

    Returns int32 ``[num_entries, 2]``: (sequence index, tile index within the sequence).
    """
    num_sequences = cu_seqlens.numel() - 1
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    tiles = (lengths + tile_tokens - 1) // tile_tokens
    tile_offsets = torch.cumsum(tiles, 0)  # [N] end offset of each sequence's tiles
    num_entries = query_tile_entries(total_tokens, num_sequences, tile_tokens)
    entry = torch.arange(num_entries, device=cu_seqlens.device)
    sequence = torch.searchsorted(tile_offsets, entry, right=True)
    valid = sequence < num_sequences
    sequence = torch.where(valid, sequence, 0)
    tile = entry - (tile_offsets[sequence] - tiles[sequence])
    order = torch.argsort(torch.where(valid, tile, -1), descending=True, stable=True)
    schedule = torch.stack([torch.where(valid, sequence, -1), torch.where(valid, tile, -1)], 1)
    return schedule[order].to(torch.int32).contiguous()
