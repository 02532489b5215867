"""The query-outer kernels' work lists (forward, dQ, the KL's query side), built on the device
without host synchronization.

- The schedule: one entry per query tile (``tile_tokens`` consecutive tokens of one sequence,
  on the sequence's own grid of tiles), most causal work first.
- ``QueryTileWork``: per tile and index head, the sorted distinct blocks its tokens kept (the
  blocks a kernel walks), each with a bit mask of the tile's tokens that kept it.

The queries may be a range of the keys' packing (``query_start``, for context parallelism): the
lists name queries by their row in the query tensors (packed token - query_start). Every size
that reaches the host is an upper bound known from the shapes alone. On a GPU Triton kernels
build the lists; on the CPU torch operations do, and the tests check that both agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..configs import SCHEDULE_KERNEL_MAX_SEQUENCES


def query_tile_entries(num_queries: int, num_sequences: int, tile_tokens: int,
                       query_start: int = 0) -> int:
    """Entries of ``query_tile_schedule``'s list: an upper bound on the tile count known from
    shapes alone. Each sequence adds at most one partial tile at its end; a query range that
    starts inside a sequence adds one more at its front."""
    return num_queries // tile_tokens + num_sequences + (1 if query_start > 0 else 0)


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


@dataclass
class QueryTileWork:
    """Query tiles (``tile_tokens`` consecutive tokens of one sequence, most work first) and, per
    tile and index head, the sorted distinct blocks its tokens kept (the blocks a query-outer
    kernel walks), each with a bit mask of the tile's tokens that kept it."""

    schedule: torch.Tensor  # int32 [E, 2]: (sequence, tile within the sequence); -1 = padding
    union: torch.Tensor  # int32 [E, Hi, tile_tokens * top_k]: distinct kept blocks, ascending
    union_members: torch.Tensor  # int64 [E, Hi, tile_tokens * top_k]: bit t = token t kept it
    union_count: torch.Tensor  # int32 [E, Hi]: how many entries of ``union`` are blocks
    tile_tokens: int


MAX_TILE_TOKENS = 64  # the bits of a union_members entry


def _check_tile_tokens(tile_tokens: int) -> None:
    """A tile's tokens must fit the bits of its members masks."""
    if not 1 <= tile_tokens <= MAX_TILE_TOKENS:
        raise ValueError(f"tile_tokens: expected 1 to {MAX_TILE_TOKENS}, received {tile_tokens}")


def _tile_queries(cu_seqlens: torch.Tensor, num_queries: int, tile_tokens: int,
                  query_start: int):
    """The query tiles' schedule, each entry's tile index (int64 ``[E]``), which of its
    ``tile_tokens`` tokens are queries (bool ``[E, tile_tokens]``) and their rows in the query
    tensors (int64, meaningful where they are queries)."""
    _check_tile_tokens(tile_tokens)
    schedule = query_tile_schedule(cu_seqlens, num_queries, tile_tokens, query_start)
    sequence, tile = schedule[:, 0].long(), schedule[:, 1].long()
    real = sequence >= 0
    sequence = sequence.clamp(min=0)
    start = cu_seqlens[sequence].long()
    length = cu_seqlens[sequence + 1].long() - start
    position = tile[:, None] * tile_tokens + torch.arange(tile_tokens, device=cu_seqlens.device)
    row = start[:, None] + position - query_start
    query = real[:, None] & (position < length[:, None]) & (row >= 0) & (row < num_queries)
    return schedule, tile, query, row


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _query_tile_union_kernel(IDS, SCHEDULE, CU_SEQLENS, UNION, MEMBERS, COUNT, query_start,
                             num_queries, stride_ids_t, stride_ids_h, num_index_heads,
                             TILE_TOKENS: tl.constexpr, TOP_K: tl.constexpr,
                             ENTRIES: tl.constexpr):
    """One (tile, index head): its tokens' kept blocks, sorted as (block, token) keys, become
    the runs of equal blocks; each run gives one union entry and the OR of its tokens' bits
    (an XOR: a token keeps a block once). Entries past the union hold -1 and 0."""
    entry = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    width = TILE_TOKENS * TOP_K
    index = tl.arange(0, ENTRIES)
    token = index // TOP_K  # the tile's token of each entry (TOP_K slots per token)
    sequence = tl.load(SCHEDULE + 2 * entry).to(tl.int64)
    tile = tl.load(SCHEDULE + 2 * entry + 1).to(tl.int64)
    start = tl.load(CU_SEQLENS + tl.maximum(sequence, 0)).to(tl.int64)
    length = tl.load(CU_SEQLENS + tl.maximum(sequence, 0) + 1).to(tl.int64) - start
    position = tile * TILE_TOKENS + token
    row = start + position - query_start
    query = ((sequence >= 0) & (index < width) & (position < length) & (row >= 0)
             & (row < num_queries))
    block = tl.load(IDS + row * stride_ids_t + head * stride_ids_h + index % TOP_K,
                    mask=query, other=-1)
    sentinel = 0x7FFFFFFF  # sorts last; its "block" (sentinel // TILE_TOKENS) is no real one
    keys = tl.sort(tl.where(block >= 0, block * TILE_TOKENS + token.to(tl.int32), sentinel))
    valid = keys != sentinel
    block = keys // TILE_TOKENS
    previous = tl.gather(block, tl.maximum(index - 1, 0), 0)
    following = tl.gather(block, tl.minimum(index + 1, ENTRIES - 1), 0)
    first = valid & ((index == 0) | (block != previous))
    last = valid & ((index == ENTRIES - 1) | (block != following))
    slot = tl.cumsum(first.to(tl.int32), 0) - 1
    count = tl.sum(first.to(tl.int32), 0)
    bits = tl.where(valid, tl.full([ENTRIES], 1, tl.int64) << (keys % TILE_TOKENS).to(tl.int64),
                    0)
    prefix = tl.associative_scan(bits, 0, _xor)  # bits of entries 0..i
    run_start = tl.associative_scan(tl.where(first, index, 0), 0, _maximum)
    before_run = tl.gather(prefix ^ bits, run_start, 0)  # bits of entries before the run
    out = (entry * num_index_heads + head) * width
    tl.store(UNION + out + slot, block, mask=first)
    tl.store(MEMBERS + out + slot, prefix ^ before_run, mask=last)
    empty = (index >= count) & (index < width)
    tl.store(UNION + out + index, -1, mask=empty)
    tl.store(MEMBERS + out + index, 0, mask=empty)
    tl.store(COUNT + entry * num_index_heads + head, count)


def _union_warps(entries: int) -> int:
    """The union kernel's warps for ``entries`` sorted keys a program: its sort network wants
    more warps only from about a thousand keys on."""
    return 8 if entries >= 1024 else 4


def build_query_tile_work(block_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                          tile_tokens: int, query_start: int = 0,
                          use_triton: bool | None = None) -> QueryTileWork:
    """block_ids: int32 ``[Tq, Hi, top_k]`` (``-1`` unused; a block at most once per row),
    relative to each sequence's start, of the packed tokens ``[query_start, query_start + Tq)``.
    Bit t of a members mask is the tile's token t, counted from the tile's first position on the
    sequence's grid. ``use_triton``: build the unions in one Triton kernel (the default on a GPU,
    where the torch operations below are slow at long sequences) or in torch operations (the
    default elsewhere)."""
    if use_triton is None:
        use_triton = block_ids.is_cuda
    if not use_triton:
        return _query_tile_work_torch(block_ids, cu_seqlens, tile_tokens, query_start)
    _check_tile_tokens(tile_tokens)
    total, num_index_heads, top_k = block_ids.shape
    if block_ids.stride(-1) != 1:
        block_ids = block_ids.contiguous()
    schedule = query_tile_schedule(cu_seqlens, total, tile_tokens, query_start)
    entries = schedule.shape[0]
    width = tile_tokens * top_k
    union = torch.empty(entries, num_index_heads, width, dtype=torch.int32,
                        device=block_ids.device)
    members = torch.empty(entries, num_index_heads, width, dtype=torch.int64,
                          device=block_ids.device)
    count = torch.empty(entries, num_index_heads, dtype=torch.int32, device=block_ids.device)
    if entries:
        entries_per_program = triton.next_power_of_2(width)
        _query_tile_union_kernel[(entries, num_index_heads)](
            block_ids, schedule, cu_seqlens, union, members, count, query_start, total,
            block_ids.stride(0), block_ids.stride(1), num_index_heads, TILE_TOKENS=tile_tokens,
            TOP_K=top_k, ENTRIES=entries_per_program,
            num_warps=_union_warps(entries_per_program))
    return QueryTileWork(schedule=schedule, union=union, union_members=members,
                         union_count=count, tile_tokens=tile_tokens)


def _query_tile_work_torch(block_ids: torch.Tensor, cu_seqlens: torch.Tensor, tile_tokens: int,
                           query_start: int = 0) -> QueryTileWork:
    """``build_query_tile_work`` in torch operations: (block, token) keys sorted per tile."""
    total, num_index_heads, top_k = block_ids.shape
    device = block_ids.device
    schedule, _, token_valid, row = _tile_queries(cu_seqlens, total, tile_tokens, query_start)
    entries = schedule.shape[0]
    token = torch.where(token_valid, row, 0)
    ids = torch.where(token_valid[..., None, None], block_ids[token], -1)  # [E, tok, Hi, k]
    ids = ids.permute(0, 2, 1, 3).long()  # [E, Hi, tok, k]
    # Sort (block, token) keys: a block's entries become a run, one per token that kept it.
    # int32 keys (a radix sort does half the passes of int64) hold blocks * 64 tokens up to
    # 2^31, far beyond any sequence length.
    sentinel = torch.iinfo(torch.int32).max
    tile_token = torch.arange(tile_tokens, device=device)[:, None]
    keys = torch.where(ids >= 0, ids * tile_tokens + tile_token, sentinel).to(torch.int32)
    keys = keys.reshape(entries, num_index_heads, -1).sort(dim=-1).values.long()
    valid = keys < sentinel
    block = keys // tile_tokens
    first_of_run = valid.clone()
    first_of_run[..., 1:] &= block[..., 1:] != block[..., :-1]
    slot = torch.cumsum(first_of_run, dim=-1) - 1  # the run's place in the union
    width = keys.shape[-1]
    # One extra column catches the entries that write nothing; it is dropped.
    union = torch.full((entries, num_index_heads, width + 1), -1, dtype=torch.int64,
                       device=device)
    union.scatter_(-1, torch.where(first_of_run, slot, width), block)
    members = torch.zeros_like(union)
    token_bit = torch.bitwise_left_shift(torch.ones_like(keys), keys % tile_tokens)
    members.scatter_add_(-1, torch.where(valid, slot, width), token_bit)
    return QueryTileWork(schedule=schedule,
                         union=union[..., :width].to(torch.int32).contiguous(),
                         union_members=members[..., :width].contiguous(),
                         union_count=first_of_run.sum(dim=-1).to(torch.int32).contiguous(),
                         tile_tokens=tile_tokens)


def build_causal_query_tile_work(cu_seqlens: torch.Tensor, num_queries: int,
                                 num_index_heads: int, tile_tokens: int, block_size: int,
                                 slots: int, query_start: int = 0) -> QueryTileWork:
    """``build_query_tile_work`` of warmup's ids (every block up to each query's own, ``slots``
    slots), built directly instead of by sorting: a tile never crosses a key block, so its
    union is blocks 0 to its own block, each kept by every query of the tile (the kernels mask
    the own block causally). Same lists, same shapes."""
    device = cu_seqlens.device
    schedule, tile, query, _ = _tile_queries(cu_seqlens, num_queries, tile_tokens, query_start)
    tile_token = torch.arange(tile_tokens, device=device)
    members = (query.long() << tile_token).sum(-1)  # [E]: the tile's queries, bit per token
    count = torch.where(query.any(-1), tile * tile_tokens // block_size + 1, 0)
    width = tile_tokens * slots
    slot = torch.arange(width, device=device)
    kept = slot[None, :] < count[:, None]  # [E, width]
    shape = (schedule.shape[0], num_index_heads, width)
    union = torch.where(kept, slot[None, :], -1).to(torch.int32)[:, None].expand(shape)
    union_members = torch.where(kept, members[:, None], 0)[:, None].expand(shape)
    return QueryTileWork(schedule=schedule, union=union.contiguous(),
                         union_members=union_members.contiguous(),
                         union_count=count.to(torch.int32)[:, None].expand(shape[:2]).contiguous(),
                         tile_tokens=tile_tokens)
