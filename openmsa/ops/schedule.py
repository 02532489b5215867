"""Work lists built on the device (no host synchronization) for kernels over packed sequences."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def batch_cu_seqlens(batch: int, seqlen: int, device) -> torch.Tensor:
    """Offsets of ``batch`` rows of ``seqlen`` tokens viewed as packed sequences: int32 [B + 1]."""
    return torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)


def query_tile_entries(num_queries: int, num_sequences: int, tile_tokens: int,
                       query_start: int = 0) -> int:
    """Entries of ``query_tile_schedule``'s list: an upper bound on the tile count known from
    shapes alone. Each sequence adds at most one partial tile at its end; a query range that
    starts inside a sequence adds one more at its front."""
    return num_queries // tile_tokens + num_sequences + (1 if query_start > 0 else 0)


# Up to this many sequences one Triton kernel builds the schedule (each of its programs reads
# every sequence's length); beyond, or on the CPU, torch operations do (~40 small kernels, 0.1 ms
# of GPU time on an H200).
SCHEDULE_KERNEL_MAX_SEQUENCES = 256


def query_tile_schedule(cu_seqlens: torch.Tensor, num_queries: int, tile_tokens: int,
                        query_start: int = 0, use_triton: bool | None = None):
    """One entry per query tile of ``tile_tokens`` tokens of every sequence, most work first.

    The queries are the packed tokens ``[query_start, query_start + num_queries)`` of the packing
    ``cu_seqlens`` describes (by default all of them). Tiles lie on each sequence's grid of
    ``tile_tokens`` positions, counted from its first token, so a tile never straddles a key
    block; a tile the query range cuts is partial, its other tokens are not queries. Causal work
    grows with a tile's position, so tiles are ordered by descending position (then by
    sequence): the long ones start first and the short ones fill the gaps. The grid size must be
    known on the host without reading ``cu_seqlens``, so the list has ``query_tile_entries``
    entries (an upper bound on the tile count); entries past the real tiles hold sequence -1.
    ``use_triton``: build it in one Triton kernel (the default on a GPU, up to
    SCHEDULE_KERNEL_MAX_SEQUENCES sequences) or in torch operations.

    Returns int32 ``[num_entries, 2]``: (sequence index, tile index within the sequence).
    """
    num_sequences = cu_seqlens.numel() - 1
    num_entries = query_tile_entries(num_queries, num_sequences, tile_tokens, query_start)
    if use_triton is None:
        use_triton = cu_seqlens.is_cuda and num_sequences <= SCHEDULE_KERNEL_MAX_SEQUENCES
    if not use_triton:
        return _query_tile_schedule_torch(cu_seqlens, num_queries, tile_tokens, query_start,
                                          num_entries)
    schedule = torch.empty(num_entries, 2, dtype=torch.int32, device=cu_seqlens.device)
    if num_entries:
        _query_tile_schedule_kernel[(max(num_sequences, 1),)](
            cu_seqlens, schedule, num_sequences, query_start, query_start + num_queries,
            num_entries, TILE_TOKENS=tile_tokens,
            SEQUENCES=max(16, triton.next_power_of_2(num_sequences)), TILES=64)
    return schedule


@triton.jit
def _tile_range(CU_SEQLENS, sequence, valid, query_start, query_end, TILE_TOKENS: tl.constexpr):
    """The tiles [first, end) of ``sequence`` that hold queries (first = end where none)."""
    start = tl.load(CU_SEQLENS + sequence, mask=valid, other=0)
    length = tl.load(CU_SEQLENS + sequence + 1, mask=valid, other=0) - start
    first_position = tl.maximum(query_start - start, 0)
    end_position = tl.minimum(query_end - start, length)
    first = first_position // TILE_TOKENS
    end = tl.where(valid & (end_position > first_position),
                   (end_position + TILE_TOKENS - 1) // TILE_TOKENS, first)
    return first, end


@triton.jit
def _query_tile_schedule_kernel(CU_SEQLENS, SCHEDULE, num_sequences, query_start, query_end,
                                num_entries, TILE_TOKENS: tl.constexpr, SEQUENCES: tl.constexpr,
                                TILES: tl.constexpr):
    """One program per sequence writes its tiles' entries: a tile's place in the order (tile
    descending, then sequence) is the number of tiles of every sequence further along, plus
    that of earlier sequences with a tile at the same position. The first program also writes
    the padding entries past the real tiles."""
    sequence = tl.program_id(0)
    others = tl.arange(0, SEQUENCES)
    other_valid = others < num_sequences
    other_first, other_end = _tile_range(CU_SEQLENS, others, other_valid, query_start,
                                         query_end, TILE_TOKENS)
    first, end = _tile_range(CU_SEQLENS, sequence, sequence < num_sequences, query_start,
                             query_end, TILE_TOKENS)
    for chunk in range(first, end, TILES):
        tile = chunk + tl.arange(0, TILES)
        further = tl.maximum(other_end[None, :] - tl.maximum(other_first[None, :],
                                                             tile[:, None] + 1), 0)
        level = ((others[None, :] < sequence) & (other_first[None, :] <= tile[:, None])
                 & (tile[:, None] < other_end[None, :]))
        place = tl.sum(further + level.to(tl.int32), axis=1)
        valid = tile < end
        tl.store(SCHEDULE + 2 * place, sequence, mask=valid)
        tl.store(SCHEDULE + 2 * place + 1, tile, mask=valid)
    if sequence == 0:
        real = tl.sum(other_end - other_first, axis=0)
        for chunk in range(real, num_entries, TILES):
            entry = chunk + tl.arange(0, TILES)
            tl.store(SCHEDULE + 2 * entry, -1, mask=entry < num_entries)
            tl.store(SCHEDULE + 2 * entry + 1, -1, mask=entry < num_entries)


def _query_tile_schedule_torch(cu_seqlens: torch.Tensor, num_queries: int, tile_tokens: int,
                               query_start: int, num_entries: int):
    """``query_tile_schedule`` in torch operations."""
    num_sequences = cu_seqlens.numel() - 1
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens[1:].long() - starts
    # Each sequence's query positions [first, end).
    first = (query_start - starts).clamp(min=0)
    end = torch.minimum(query_start + num_queries - starts, lengths)
    first_tile = first // tile_tokens
    tiles = torch.where(end > first, (end + tile_tokens - 1) // tile_tokens - first_tile, 0)
    tile_offsets = torch.cumsum(tiles, 0)  # [N] end offset of each sequence's tiles
    entry = torch.arange(num_entries, device=cu_seqlens.device)
    sequence = torch.searchsorted(tile_offsets, entry, right=True)
    valid = sequence < num_sequences
    sequence = torch.where(valid, sequence, 0)
    tile = first_tile[sequence] + entry - (tile_offsets[sequence] - tiles[sequence])
    order = torch.argsort(torch.where(valid, tile, -1), descending=True, stable=True)
    schedule = torch.stack([torch.where(valid, sequence, -1), torch.where(valid, tile, -1)], 1)
    return schedule[order].to(torch.int32).contiguous()
