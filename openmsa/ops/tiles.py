"""Triton helpers shared by the query-outer kernels (forward, dQ, the KL's query side) and the
key-outer ones (dK/dV, the KL): a query tile's rows, its walk list, row and token masks, rows
loaded by packed token, the keys of a block, a key-outer segment.

A query tile is ``TOK`` consecutive tokens of one sequence times the ``GQ`` main heads of one
index head, head-major (row = g * TOK + t), about 128 MMA rows: each token brings only GQ rows,
too few for the tensor cores alone.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _query_tile(SCHEDULE, CU_SEQLENS, entry, index_head, query_start, query_end, GQ: tl.constexpr,
                TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr):
    """A (real) query tile: TOK consecutive positions of one sequence on its grid of TOK
    positions; its MMA rows are the GQ heads of ``index_head`` x the tokens, head-major
    (row = g * TOK + t; rows of heads >= GQ are padding). Only the packed tokens
    [query_start, query_end) are queries (a context-parallel rank's range); the tile's other
    tokens are padding, and a query's row in Q, out and the other query-side tensors is its
    packed token - query_start.
    Returns the sequence's start and length, the tile's first position, the members mask of a
    block every query of the tile kept, per-row (valid, query row, position, head) and
    per-token rows padded to TOKP (valid, query row, position)."""
    sequence = tl.load(SCHEDULE + 2 * entry).to(tl.int64)
    tile = tl.load(SCHEDULE + 2 * entry + 1).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    first_position = tile * TOK
    # The tile's queries are its tokens [first_query, end_query).
    first_query = tl.maximum(query_start - seq_start - first_position, 0)
    end_query = tl.minimum(tl.minimum(query_end - seq_start, seq_len) - first_position, TOK)
    one = tl.full((), 1, tl.int64)
    all_members = (tl.where(end_query >= 64, -1, (one << end_query) - 1)
                   - ((one << first_query) - 1))
    query_base = seq_start - query_start  # the query row of the sequence's position 0
    # Tokens padded to TOKP (>= 16) rows, the M of the index-branch MMAs; rows TOK.. are empty.
    padded = tl.arange(0, TOKP)
    tok_position = first_position + padded
    tok_valid = (padded >= first_query) & (padded < end_query)
    rows = tl.arange(0, ROWS)
    row_position = first_position + rows % TOK
    row_valid = (rows // TOK < GQ) & (rows % TOK >= first_query) & (rows % TOK < end_query)
    row_head = index_head * GQ + rows // TOK
    return (seq_start, seq_len, first_position, all_members, row_valid,
            query_base + row_position, row_position, row_head, tok_valid,
            query_base + tok_position, tok_position)


@triton.jit
def _members(members, row_valid, tok_valid, TOK: tl.constexpr, TOKP: tl.constexpr,
             ROWS: tl.constexpr):
    """Which rows and tokens kept a block, from its mask of the tile's tokens that kept it."""
    row_bit = (tl.arange(0, ROWS) % TOK).to(tl.int64)
    tok_bit = tl.arange(0, TOKP).to(tl.int64) % TOK
    row_member = (((members >> row_bit) & 1) != 0) & row_valid
    tok_member = (((members >> tok_bit) & 1) != 0) & tok_valid
    return row_member, tok_member


@triton.jit
def _walk_list(UNION, UNION_MEMBERS, UNION_COUNT, entry, index_head, HI: tl.constexpr,
               UNION_SLOTS: tl.constexpr):
    """A query tile's walk list: its distinct kept blocks, their token masks and their count."""
    offset = (entry * HI + index_head) * UNION_SLOTS
    return UNION + offset, UNION_MEMBERS + offset, tl.load(UNION_COUNT + entry * HI + index_head)


@triton.jit
def _walk_block(blocks, members_of, u, first_position, all_members, BLOCK: tl.constexpr):
    """Entry ``u`` of a walk list: the block, its token mask, and whether the block needs a mask
    (a block before the tile that every token kept needs none; rows of padding heads or of
    tokens past the sequence are computed there but never stored)."""
    block = tl.load(blocks + u).to(tl.int64)
    members = tl.load(members_of + u)
    needs_mask = (block * BLOCK + BLOCK > first_position) | (members != all_members)
    return block, members, needs_mask


@triton.jit
def _load_rows(PTR, rows, valid, head, stride_t, stride_h, DIM: tl.constexpr):
    """[len(rows), DIM] of one head at packed token ``rows`` (zeros where not ``valid``)."""
    dims = tl.arange(0, DIM)
    return tl.load(PTR + rows[:, None] * stride_t + head * stride_h + dims[None, :],
                   mask=valid[:, None], other=0.0)


@triton.jit
def _block_keys(seq_start, seq_len, block, BLOCK: tl.constexpr):
    """Positions, validity and packed token of the keys of ``block``."""
    key_pos = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    return key_pos, key_pos < seq_len, seq_start + key_pos


@triton.jit
def _segment(SEGMENTS, SEGMENT_ORDER, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL,
             CU_SEQLENS, query_start, HI: tl.constexpr, SEGMENT_PAIRS: tl.constexpr):
    """This program's segment of a key-block -> queries list: (segment, its pairs [first, last),
    index head, local block, sequence start and length, and the query row of the sequence's
    position 0: pairs name query rows, packed token - query_start); segment -1 is padding."""
    segment = tl.load(SEGMENT_ORDER + tl.program_id(0)).to(tl.int64)
    return _segment_at(SEGMENTS, segment, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
                       BLOCK_LOCAL, CU_SEQLENS, query_start, HI, SEGMENT_PAIRS)


@triton.jit
def _segment_at(SEGMENTS, segment, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL,
                CU_SEQLENS, query_start, HI: tl.constexpr, SEGMENT_PAIRS: tl.constexpr):
    """``_segment`` of segment number ``segment`` (int64)."""
    bucket = tl.load(SEGMENTS + 2 * segment).to(tl.int64)
    valid_bucket = tl.maximum(bucket, 0)
    first = tl.load(SEGMENTS + 2 * segment + 1).to(tl.int64)
    global_block = valid_bucket // HI
    sequence = tl.maximum(tl.load(BLOCK_SEQUENCE + global_block).to(tl.int64), 0)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    bucket_end = (tl.load(BUCKET_START + valid_bucket)
                  + tl.load(BUCKET_COUNT + valid_bucket)).to(tl.int64)
    last = tl.minimum(first + SEGMENT_PAIRS, bucket_end)
    block = tl.load(BLOCK_LOCAL + global_block).to(tl.int64)
    return (tl.where(bucket < 0, -1, segment), first, last, valid_bucket % HI, block,
            seq_start, seq_len, seq_start - query_start)
