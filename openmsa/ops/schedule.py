"""Work lists built on the device (no host synchronization) for kernels over packed sequences."""

from __future__ import annotations

import torch


def batch_cu_seqlens(batch: int, seqlen: int, device) -> torch.Tensor:
    """Offsets of ``batch`` rows of ``seqlen`` tokens viewed as packed sequences: int32 [B + 1]."""
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def query_tile_entries(num_queries: int, num_sequences: int, tile_tokens: int,
                       query_start: int = 0) -> int:
    """Entries of ``query_tile_schedule``'s list: an upper bound on the tile count known from
    shapes alone. Each sequence adds at most one partial tile at its end; a query range that
    starts inside a sequence adds one more at its front."""
    return num_queries // tile_tokens + num_sequences + (1 if query_start > 0 else 0)


def query_tile_schedule(cu_seqlens: torch.Tensor, num_queries: int, tile_tokens: int,
                        query_start: int = 0):
    """One entry per query tile of ``tile_tokens`` tokens of every sequence, most work first.

    The queries are the packed tokens ``[query_start, query_start + num_queries)`` of the packing
    ``cu_seqlens`` describes (by default all of them). Tiles lie on each sequence's grid of
    ``tile_tokens`` positions, counted from its first token, so a tile never straddles a key
    block; a tile the query range cuts is partial, its other tokens are not queries. Causal work
    grows with a tile's position, so tiles are ordered by descending position: the long ones
    start first and the short ones fill the gaps. The grid size must be known on the host
    without reading ``cu_seqlens``, so the list has ``query_tile_entries`` entries (an upper
    bound on the tile count); entries past the real tiles hold sequence -1.

    Returns int32 ``[num_entries, 2]``: (sequence index, tile index within the sequence).
    """
    num_sequences = cu_seqlens.numel() - 1
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    # Each sequence's query positions [first, end).
    first = (query_start - starts).clamp(min=0)
    end = torch.minimum(query_start + num_queries - starts, lengths)
    first_tile = first // tile_tokens
    tiles = torch.where(end > first, (end + tile_tokens - 1) // tile_tokens - first_tile, 0)
    tile_offsets = torch.cumsum(tiles, 0)  # [N] end offset of each sequence's tiles
    num_entries = query_tile_entries(num_queries, num_sequences, tile_tokens, query_start)
    entry = torch.arange(num_entries, device=cu_seqlens.device)
    sequence = torch.searchsorted(tile_offsets, entry, right=True)
    valid = sequence < num_sequences
    sequence = torch.where(valid, sequence, 0)
    tile = first_tile[sequence] + entry - (tile_offsets[sequence] - tiles[sequence])
    order = torch.argsort(torch.where(valid, tile, -1), descending=True, stable=True)
    schedule = torch.stack([torch.where(valid, sequence, -1), torch.where(valid, tile, -1)], 1)
    return schedule[order].to(torch.int32).contiguous()
