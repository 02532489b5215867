"""The main attention's forward and dQ, key-outer, for the query tiles whose walk would be long.

A query-outer tile (``TOK`` tokens x ``GQ`` heads) walks the union of its tokens' kept blocks,
and each block's product costs the whole tile's rows however few of its tokens kept it: on
selections whose neighbours keep different blocks (a union of many times ``top_k``) most of
the work is discarded. Here the tiles whose union holds more than a limit of blocks ("hard"
tiles) are taken key-outer instead, on a key-block -> queries list of their pairs alone (built
as dK/dV's): a program per segment of one key block's pairs gathers ``TOK`` pairs' rows at a
time, every row of which kept the block, so the cost follows the kept pairs.

Forward: each (row, kept block) writes its partial output (normalized over that block) and
its log-sum-exp into the row's slot (the block's position in the row's ids, which the
list build records for each pair), and a combine
step merges a row's ``top_k`` slots by their log-sum-exps. dQ: each (row, kept block) writes
its partial (fp32, or in the inputs' precision: ``Tuning.key_outer_dq_partials``), and a sum
adds a row's slots in slot order in fp32. No atomics: both are
deterministic. The slots of a window of query rows at a time live in memory
(``Tuning.key_outer_partial_bytes`` bounds them), so the passes run once per window.

With ``Tuning.dq_pass = "hard_atomic"`` the hard rows' dQ comes from the dK/dV pass instead
(``dkdv_with_hard_atomic_dq``): its steps gather the same q and dO rows and compute the same
dS, so one more product ``dS K``, added atomically into an fp32 sum, replaces the key-outer
dQ's gathers, two of its three products, its partials and their sum. The dK/dV segments that
hold a hard pair run on the Triton kernel that adds them; the others on the usual dK/dV
kernel (Gluon on Hopper GPUs), which skips the flagged ones: coherent selections, with few or
no hard rows, keep their dK/dV pass, and random ones run the atomic dQ of ``dq_pass =
"dkdv_atomic"`` on the rows that need it. Not bitwise reproducible (``deterministic=True``
keeps the key-outer dQ).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import (KEY_OUTER_COMBINE_ROWS, KEY_OUTER_COMBINE_WARPS, KEY_OUTER_CONFIG,
                       KEY_OUTER_HOPPER, KEY_OUTER_SUM_ROWS)
from ..launch import launch, strides
from ..problem import LOG2_E, SparseAttentionProblem
from ..tiles import _block_keys, _load_rows, _query_tile, _segment
from ..worklists import BlockWork
from . import sm90_key_outer
from .backward import (_over_heads, _pair_rows, dq_from_sum, new_dkdv_parts,
                       reduce_dkdv_parts)

__all__ = ["dkdv_with_hard_atomic_dq", "key_outer_dq", "key_outer_forward", "walk_limit"]


def walk_limit(p: SparseAttentionProblem) -> int:
    """The most blocks a query tile's walk (forward and dQ) takes before its rows go key-outer;
    0: every tile walks (warmup keeps every causal block, so its tiles never go; nor where no
    union can pass the limit: short sequences then skip the key-outer passes' lists, launches
    and partials)."""
    per_slot = p.tuning.main_walk_limit_per_slot
    if per_slot <= 0 or p.all_causal:
        return 0
    limit = max(1, int(per_slot * p.top_k))
    return limit if limit < p.union_bound(p.query_work) else 0


@triton.jit
def _hard_rows_kernel(HARD, DQ_SUM, SCHEDULE, UNION_COUNT, CU_SEQLENS, query_start, query_end,
                      limit, HI: tl.constexpr, GQ: tl.constexpr, TOK: tl.constexpr,
                      TOKP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr = 16,
                      ZERO_DQ_SUM: tl.constexpr = False):
    """HARD[row, index head] = 1 for the rows of each (query tile, index head) whose union holds
    more than ``limit`` blocks, 0 for the others. ZERO_DQ_SUM: the hard rows' GQ heads of
    DQ_SUM [Tq, HI * GQ, HEAD_DIM] (fp32) zeroed too (the atomic adds' sum, zeroed where
    they go only)."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:  # padding entry
        return
    (_, _, _, _, _, _, _, _, tok_valid, tok_token, _) = _query_tile(
        SCHEDULE, CU_SEQLENS, entry, index_head, query_start, query_end, GQ, TOK, TOKP, ROWS)
    hard = tl.load(UNION_COUNT + entry * HI + index_head) > limit
    tl.store(HARD + tok_token * HI + index_head,
             tl.zeros((TOKP,), tl.int8) + hard.to(tl.int8), mask=tok_valid)
    if ZERO_DQ_SUM:
        if hard:
            dims = tl.arange(0, HEAD_DIM)
            for g in range(GQ):
                row = tok_token * (HI * GQ) + index_head * GQ + g
                tl.store(DQ_SUM + row[:, None] * HEAD_DIM + dims[None, :],
                         tl.zeros((TOKP, HEAD_DIM), tl.float32), mask=tok_valid[:, None])


def hard_rows(p: SparseAttentionProblem, limit: int, dq_sum=None) -> torch.Tensor:
    """int8 [Tq, Hi]: 1 where a row's tile goes key-outer at walk limit ``limit``; ``dq_sum``
    (fp32 [Tq, H, D]): those rows zeroed there."""
    hard = torch.zeros(p.total, p.num_index_heads, dtype=torch.int8,
                       device=p.block_ids.device)
    constants = p.query_constants()
    _hard_rows_kernel[p.query_grid()](
        hard, dq_sum, p.query_work.schedule, p.query_work.union_count, p.cu_seqlens,
        p.query_start, p.query_start + p.total, limit, HI=p.num_index_heads, GQ=p.gq,
        TOK=constants["TOK"], TOKP=constants["TOKP"], ROWS=constants["ROWS"],
        HEAD_DIM=p.head_dim, ZERO_DQ_SUM=dq_sum is not None)
    return hard


@triton.jit
def _window_bounds_kernel(BOUNDS, SEGMENTS, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT,
                          num_segments, num_rows, window_rows, num_bounds,
                          SEGMENT_PAIRS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                          SEGS: tl.constexpr, BOUNDS_PAD: tl.constexpr):
    """BOUNDS[segment, w]: the first of the segment's pairs whose query row is at least
    ``min(w x window_rows, num_rows)`` (pairs ascend by row within a segment), so window w's
    pairs of the segment are [BOUNDS[segment, w], BOUNDS[segment, w + 1]); a padding segment
    has none."""
    segment = tl.program_id(0).to(tl.int64) * SEGS + tl.arange(0, SEGS)
    in_list = segment < num_segments
    bucket = tl.load(SEGMENTS + 2 * segment, mask=in_list, other=-1)
    first = tl.load(SEGMENTS + 2 * segment + 1, mask=in_list, other=0)
    valid_bucket = tl.maximum(bucket, 0)
    bucket_end = tl.load(BUCKET_START + valid_bucket) + tl.load(BUCKET_COUNT + valid_bucket)
    last = tl.where(bucket < 0, first, tl.minimum(first + SEGMENT_PAIRS, bucket_end))
    bound = tl.program_id(1) * BOUNDS_PAD + tl.arange(0, BOUNDS_PAD)
    row = tl.minimum(bound.to(tl.int64) * window_rows, num_rows)
    low = tl.broadcast_to(first[:, None], (SEGS, BOUNDS_PAD))
    high = tl.broadcast_to(last[:, None], (SEGS, BOUNDS_PAD))
    for _ in tl.static_range(SEARCH_STEPS):
        middle = (low + high) // 2
        active = low < high
        below = tl.load(PAIR_TOKEN + middle, mask=active, other=0) < row[None, :]
        low = tl.where(active & below, middle + 1, low)
        high = tl.where(active & ~below, middle, high)
    tl.store(BOUNDS + segment[:, None] * num_bounds + bound[None, :], low,
             mask=in_list[:, None] & (bound < num_bounds)[None, :])


def window_bounds(work: BlockWork, num_rows: int, window_rows: int,
                  windows: int) -> torch.Tensor:
    """int32 [segments, windows + 1]: each window's pairs of each segment of a key-block list
    (the hard pairs'; ``_window_bounds_kernel``), found once a pass for all windows
    instead of by each key-outer program."""
    segments = work.segments.shape[0]
    bounds = torch.empty(segments, windows + 1, dtype=torch.int32,
                         device=work.pair_token.device)
    segs, pad = 32, min(64, triton.next_power_of_2(windows + 1))
    _window_bounds_kernel[(triton.cdiv(segments, segs), triton.cdiv(windows + 1, pad))](
        bounds, work.segments, work.pair_token, work.bucket_start, work.bucket_count, segments,
        num_rows, window_rows, windows + 1, SEGMENT_PAIRS=work.segment_pairs,
        SEARCH_STEPS=work.segment_pairs.bit_length() + 1, SEGS=segs, BOUNDS_PAD=pad)
    return bounds


@triton.jit
def _window_segment(SEGMENTS, SEGMENT_ORDER, BOUNDS, window, BUCKET_START, BUCKET_COUNT,
                    BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS, query_start, num_bounds,
                    HI: tl.constexpr, SEGMENT_PAIRS: tl.constexpr):
    """This program's segment (``tiles._segment``) cut to the window's pairs [low, high)
    (``window_bounds``; none for a padding segment), its index head, local block, sequence
    start and length, and the query row of the sequence's position 0."""
    segment, first, last, index_head, block, seq_start, seq_len, query_base = _segment(
        SEGMENTS, SEGMENT_ORDER, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL,
        CU_SEQLENS, query_start, HI, SEGMENT_PAIRS)
    bounds = BOUNDS + tl.maximum(segment, 0) * num_bounds + window
    low = tl.load(bounds)
    high = tl.where(segment < 0, low, tl.load(bounds + 1))
    return low, high, index_head, block, seq_start, seq_len, query_base


@triton.jit
def _block_kv(K, V, seq_start, seq_len, block, kv_head, stride_k_t, stride_k_h, stride_v_t,
              stride_v_h, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The block's key positions and validity, and its K and V rows of ``kv_head``."""
    key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
    k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
    v = _load_rows(V, key_token, key_valid, kv_head, stride_v_t, stride_v_h, HEAD_DIM)
    return key_pos, key_valid, k, v


@triton.jit
def _pair_rows_and_slots(PAIR_TOKEN, PAIR_SLOT, first_pair, end, GQ: tl.constexpr,
                         GQ_PAD: tl.constexpr, TOK: tl.constexpr):
    """The TOK pairs from ``first_pair`` (before ``end``), head-major as the dK/dV kernel's rows
    (``backward._pair_rows``, row = g * TOK + t): each row's query row, validity, head g and
    its pair's slot (the block's position in the row's ids)."""
    row_token, row_valid, _, pair_valid = _pair_rows(PAIR_TOKEN, first_pair, end, GQ, GQ_PAD,
                                                     TOK)
    slot = tl.load(PAIR_SLOT + first_pair + tl.arange(0, TOK), mask=pair_valid, other=0)
    return (row_token, row_valid, tl.arange(0, GQ_PAD * TOK) // TOK,
            _over_heads(slot, GQ_PAD, TOK))


@triton.jit
def _fwd_key_outer_kernel(
    Q, K, V, WINDOW_HARD, window, BOUNDS, num_bounds, OUT_PART, LSE_PART,
    SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, PAIR_SLOT, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
    BLOCK_LOCAL, CU_SEQLENS, query_start, window_start,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    TOK: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TOP_K: tl.constexpr,
    SEGMENT_PAIRS: tl.constexpr, PRECISION: tl.constexpr,
):
    """One segment of a key block's pairs, the window's hard rows: per row, the softmax over
    the block's visible keys, its output (normalized) and log-sum-exp (base 2) into the row's
    slot of OUT_PART [window rows, HI, TOP_K, GQ, D] and LSE_PART [..., GQ]."""
    if tl.load(WINDOW_HARD + window) == 0:  # no hard row in the window
        return
    low, high, index_head, block, seq_start, seq_len, query_base = _window_segment(
        SEGMENTS, SEGMENT_ORDER, BOUNDS, window, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
        BLOCK_LOCAL, CU_SEQLENS, query_start, num_bounds, HI, SEGMENT_PAIRS)
    if low >= high:
        return
    key_pos, key_valid, k, v = _block_kv(K, V, seq_start, seq_len, block,
                                         index_head // KV_GROUP, stride_k_t, stride_k_h,
                                         stride_v_t, stride_v_h, BLOCK, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    for first_pair in range(low, high, TOK):
        row_token, row_valid, head, row_slot = _pair_rows_and_slots(
            PAIR_TOKEN, PAIR_SLOT, first_pair, high, GQ, GQ_PAD, TOK)
        q = tl.load(Q + row_token[:, None] * stride_q_t
                    + (index_head * GQ + head)[:, None] * stride_q_h + dims[None, :],
                    mask=row_valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        # Pairs ascend by row: only when the first lies inside the block can any need the
        # causal mask (which also hides keys past the sequence's end).
        if tl.load(PAIR_TOKEN + first_pair) - query_base < block * BLOCK + BLOCK - 1:
            query_pos = row_token - query_base
            scores = tl.where(key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None]),
                              scores, float("-inf"))
        row_max = tl.max(scores, axis=1)
        safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        probs = tl.exp2(scores - safe_max[:, None])
        row_sum = tl.sum(probs, axis=1)
        out = tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        out = out / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        slot = ((row_token - window_start) * HI + index_head) * TOP_K + row_slot
        offsets = slot * GQ + head
        tl.store(OUT_PART + offsets[:, None] * HEAD_DIM + dims[None, :],
                 out.to(OUT_PART.dtype.element_ty), mask=row_valid[:, None])
        tl.store(LSE_PART + offsets, safe_max + tl.log2(tl.where(row_valid, row_sum, 1.0)),
                 mask=row_valid)


@triton.jit
def _slot_rows(IDS, HARD, window_start, window_end, stride_ids_t, stride_ids_h,
               HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr,
               TOKENS: tl.constexpr):
    """A combine program's rows: TOKENS query rows x GQ heads of index head program_id(1)
    (row-major: i = t * GQ_PAD + g), their validity (hard rows of the window), query row, head
    g, the first of their slots' offsets and their ids' address."""
    index_head = tl.program_id(1).to(tl.int64)
    lanes = tl.arange(0, TOKENS * GQ_PAD)
    token = window_start + tl.program_id(0).to(tl.int64) * TOKENS + lanes // GQ_PAD
    head = lanes % GQ_PAD
    valid = (token < window_end) & (head < GQ)
    valid &= tl.load(HARD + token * HI + index_head, mask=valid, other=0) != 0
    first_slot = ((token - window_start) * HI + index_head)
    return (valid, token, head, index_head, first_slot,
            IDS + token * stride_ids_t + index_head * stride_ids_h)


@triton.jit
def _combine_kernel(IDS, HARD, WINDOW_HARD, window, OUT_PART, LSE_PART, OUT, LSE,
                    window_start, window_end, stride_ids_t, stride_ids_h, stride_o_t, stride_o_h,
                    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr,
                    TOP_K: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr):
    """The hard rows' out and lse2 from their kept slots' partials, merged by log-sum-exp."""
    if tl.load(WINDOW_HARD + window) == 0:
        return
    valid, token, head, index_head, first_slot, ids = _slot_rows(
        IDS, HARD, window_start, window_end, stride_ids_t, stride_ids_h, HI, GQ, GQ_PAD, TOKENS)
    dims = tl.arange(0, HEAD_DIM)
    lse_max = tl.full((TOKENS * GQ_PAD,), float("-inf"), tl.float32)
    for s in tl.static_range(TOP_K):
        kept = valid & (tl.load(ids + s, mask=valid, other=-1) >= 0)
        lse_s = tl.load(LSE_PART + (first_slot * TOP_K + s) * GQ + head, mask=kept,
                        other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse_s)
    safe_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.zeros((TOKENS * GQ_PAD,), tl.float32)
    acc = tl.zeros((TOKENS * GQ_PAD, HEAD_DIM), tl.float32)
    for s in tl.static_range(TOP_K):
        kept = valid & (tl.load(ids + s, mask=valid, other=-1) >= 0)
        offsets = (first_slot * TOP_K + s) * GQ + head
        weight = tl.exp2(tl.load(LSE_PART + offsets, mask=kept, other=float("-inf")) - safe_max)
        part = tl.load(OUT_PART + offsets[:, None] * HEAD_DIM + dims[None, :],
                       mask=kept[:, None], other=0.0)
        total += weight
        acc += weight[:, None] * part.to(tl.float32)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_head = index_head * GQ + head
    tl.store(OUT + token[:, None] * stride_o_t + out_head[:, None] * stride_o_h + dims[None, :],
             out.to(OUT.dtype.element_ty), mask=valid[:, None])
    lse = tl.where(total > 0, safe_max + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
    tl.store(LSE + token * (HI * GQ) + out_head, lse, mask=valid)


@triton.jit
def _dq_key_outer_kernel(
    Q, K, V, DOUT, LSE, DELTA, WINDOW_HARD, window, BOUNDS, num_bounds, DQ_PART,
    SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, PAIR_SLOT, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
    BLOCK_LOCAL, CU_SEQLENS, query_start, window_start,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    TOK: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TOP_K: tl.constexpr,
    SEGMENT_PAIRS: tl.constexpr, PRECISION: tl.constexpr,
):
    """One segment of a key block's pairs, the window's hard rows: each row's dQ over the
    block (unscaled, fp32; stored in DQ_PART's precision) into its slot of DQ_PART [window rows,
    HI, TOP_K, GQ, D]."""
    if tl.load(WINDOW_HARD + window) == 0:  # no hard row in the window
        return
    low, high, index_head, block, seq_start, seq_len, query_base = _window_segment(
        SEGMENTS, SEGMENT_ORDER, BOUNDS, window, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
        BLOCK_LOCAL, CU_SEQLENS, query_start, num_bounds, HI, SEGMENT_PAIRS)
    if low >= high:
        return
    key_pos, key_valid, k, v = _block_kv(K, V, seq_start, seq_len, block,
                                         index_head // KV_GROUP, stride_k_t, stride_k_h,
                                         stride_v_t, stride_v_h, BLOCK, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    for first_pair in range(low, high, TOK):
        row_token, row_valid, head, row_slot = _pair_rows_and_slots(
            PAIR_TOKEN, PAIR_SLOT, first_pair, high, GQ, GQ_PAD, TOK)
        row_head = index_head * GQ + head
        q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                    + dims[None, :], mask=row_valid[:, None], other=0.0)
        dout = tl.load(DOUT + row_token[:, None] * stride_do_t
                       + row_head[:, None] * stride_do_h + dims[None, :],
                       mask=row_valid[:, None], other=0.0)
        lse = tl.load(LSE + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
        delta = tl.load(DELTA + row_token * (HI * GQ) + row_head, mask=row_valid,
                        other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        probs = tl.exp2(scores - lse[:, None])
        if tl.load(PAIR_TOKEN + first_pair) - query_base < block * BLOCK + BLOCK - 1:
            query_pos = row_token - query_base
            probs = tl.where(key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None]),
                             probs, 0.0)
        dprobs = tl.dot(dout, tl.trans(v), input_precision=PRECISION)
        dscores = probs * (dprobs - delta[:, None])
        dq = tl.dot(dscores.to(k.dtype), k, input_precision=PRECISION)
        offsets = ((row_token - window_start) * HI + index_head) * TOP_K + row_slot
        tl.store(DQ_PART + (offsets * GQ + head)[:, None] * HEAD_DIM + dims[None, :],
                 dq.to(DQ_PART.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _dq_sum_kernel(IDS, HARD, WINDOW_HARD, window, DQ_PART, DQ, window_start, window_end,
                   stride_ids_t, stride_ids_h, stride_dq_t, stride_dq_h, scale, HI: tl.constexpr,
                   GQ: tl.constexpr, GQ_PAD: tl.constexpr, TOP_K: tl.constexpr,
                   HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr):
    """The hard rows' dq: ``scale`` x the sum of their kept slots' partials, in slot order."""
    if tl.load(WINDOW_HARD + window) == 0:
        return
    valid, token, head, index_head, first_slot, ids = _slot_rows(
        IDS, HARD, window_start, window_end, stride_ids_t, stride_ids_h, HI, GQ, GQ_PAD, TOKENS)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros((TOKENS * GQ_PAD, HEAD_DIM), tl.float32)
    for s in tl.static_range(TOP_K):
        kept = valid & (tl.load(ids + s, mask=valid, other=-1) >= 0)
        offsets = (first_slot * TOP_K + s) * GQ + head
        acc += tl.load(DQ_PART + offsets[:, None] * HEAD_DIM + dims[None, :],
                       mask=kept[:, None], other=0.0).to(tl.float32)
    out_head = index_head * GQ + head
    tl.store(DQ + token[:, None] * stride_dq_t + out_head[:, None] * stride_dq_h
             + dims[None, :], (acc * scale).to(DQ.dtype.element_ty), mask=valid[:, None])


def _windows(p: SparseAttentionProblem, bytes_per_slot: int, hard: torch.Tensor,
             work: BlockWork):
    """Query-row windows [start, end) whose slots fit ``Tuning.key_outer_partial_bytes``, each
    window's count of hard (row, index head)s (int32 on the device: a window without any
    costs its launches only, nothing waits for the GPU) and each window's pairs of each
    segment of the key-block list ``work`` (``window_bounds``)."""
    per_row = p.num_index_heads * p.top_k * p.gq * bytes_per_slot
    rows = min(p.total, max(1, p.tuning.key_outer_partial_bytes // per_row))
    windows = [(start, min(start + rows, p.total)) for start in range(0, p.total, rows)]
    padded = torch.nn.functional.pad(hard, (0, 0, 0, len(windows) * rows - p.total))
    counts = padded.view(len(windows), -1).sum(1, dtype=torch.int32)
    bounds = window_bounds(work, p.total, rows, len(windows))
    return rows, windows, counts, bounds


def _block_ids(p: SparseAttentionProblem) -> torch.Tensor:
    """``p``'s kept block ids with unit stride along the slots, as the combine and the dQ sum
    read them."""
    return p.block_ids if p.block_ids.stride(-1) == 1 else p.block_ids.contiguous()


def _dq_part_dtype(p: SparseAttentionProblem, q) -> torch.dtype:
    """The hard rows' dQ partials' dtype (``Tuning.key_outer_dq_partials``)."""
    return torch.float32 if p.tuning.key_outer_dq_partials == "float32" else q.dtype


def _sum_dq_window(ids, hard, window_hard, window: int, dq_part, dq, start: int, end: int,
                   p: SparseAttentionProblem) -> None:
    """The window's hard rows of ``dq``: their slots' partials summed in slot order
    (``_dq_sum_kernel``)."""
    tokens = _combine_tokens(p, KEY_OUTER_SUM_ROWS)
    _dq_sum_kernel[(triton.cdiv(end - start, tokens), p.num_index_heads)](
        ids, hard, window_hard, window, dq_part, dq, start, end, *strides(ids, dq), p.scale,
        HI=p.num_index_heads, GQ=p.gq, GQ_PAD=p.shared["GQ_PAD"], TOP_K=p.top_k,
        HEAD_DIM=p.head_dim, TOKENS=tokens, num_warps=KEY_OUTER_COMBINE_WARPS)


def _hard_work(p: SparseAttentionProblem, limit: int):
    """The hard rows (``hard_rows``) and the key-block -> queries list of their pairs alone,
    itself and as the key-outer kernels' arguments and constants: every gathered row then
    computes (no pair of a walked row rides along), at the cost of one more list build."""
    hard = hard_rows(p, limit)
    work = p.block_work_of_rows(hard)
    arguments = (work.segments, work.segment_order, work.pair_token, work.pair_slot,
                 work.bucket_start, work.bucket_count, work.block_sequence, work.block_local,
                 p.cu_seqlens, p.query_start)
    shared = p.shared
    constants = dict(HI=shared["HI"], GQ=shared["GQ"], GQ_PAD=shared["GQ_PAD"],
                     KV_GROUP=shared["KV_GROUP"], TOK=p.query_tokens, BLOCK=p.block_size,
                     HEAD_DIM=p.head_dim, TOP_K=p.top_k, SEGMENT_PAIRS=work.segment_pairs,
                     PRECISION=shared["PRECISION"])
    return hard, work, arguments, constants


def _combine_tokens(p: SparseAttentionProblem, rows_per_program: int) -> int:
    """Query rows per program of the combine or the dQ sum, for ``rows_per_program`` rows
    (x GQ_PAD heads) on the GPU; the interpreter's cost is per program, so wide ones there."""
    rows = rows_per_program if p.block_ids.is_cuda else 1024
    return max(1, rows // p.shared["GQ_PAD"])


def _use_hopper(use_hopper: bool | None, supported: bool) -> bool:
    """Whether the Gluon kernels run the key-outer passes: where they support the inputs,
    unless ``use_hopper`` is False or ``KEY_OUTER_HOPPER`` is off (benchmarks time both)."""
    return use_hopper is not False and KEY_OUTER_HOPPER and supported


def key_outer_forward(q, k, v, p: SparseAttentionProblem, limit: int, out, lse,
                      use_hopper: bool | None = None):
    """Writes ``out`` [Tq, H, D] and ``lse`` (lse2, [Tq, H]) of the rows whose tiles' unions
    hold more than ``limit`` blocks (the walk left them), window by window: the partials from
    the Gluon kernel on a Hopper GPU where it takes the inputs, else from the Triton one."""
    hard, work, arguments, constants = _hard_work(p, limit)
    segments = work.segments.shape[0]
    rows, windows, window_hard, bounds = _windows(p, q.element_size() * p.head_dim + 4, hard,
                                                  work)
    ids = _block_ids(p)
    slots = rows * p.num_index_heads * p.top_k * p.gq
    out_part = torch.empty(slots, p.head_dim, dtype=q.dtype, device=q.device)
    lse_part = torch.empty(slots, dtype=torch.float32, device=q.device)
    tokens = _combine_tokens(p, KEY_OUTER_COMBINE_ROWS)
    hopper = _use_hopper(use_hopper, sm90_key_outer.supported(q, k, v, p))
    descriptors = sm90_key_outer.block_descriptors(k, v, p.block_size) if hopper else None
    for window, (start, end) in enumerate(windows):
        if hopper:
            sm90_key_outer.launch_key_outer(q, descriptors, window_hard, window, bounds,
                                            out_part, lse_part, arguments, start, segments,
                                            constants, p.scale * LOG2_E)
        else:
            launch(_fwd_key_outer_kernel, (segments,),
                   q, k, v, window_hard, window, bounds, bounds.shape[1], out_part, lse_part,
                   *arguments, start, *strides(q, k, v), p.scale * LOG2_E, **constants,
                   **KEY_OUTER_CONFIG)
        _combine_kernel[(triton.cdiv(end - start, tokens), p.num_index_heads)](
            ids, hard, window_hard, window, out_part, lse_part, out, lse, start, end,
            *strides(ids, out), HI=p.num_index_heads, GQ=p.gq, GQ_PAD=p.shared["GQ_PAD"],
            TOP_K=p.top_k, HEAD_DIM=p.head_dim, TOKENS=tokens,
            num_warps=KEY_OUTER_COMBINE_WARPS)
    return out, lse


def key_outer_dq(q, k, v, dout, lse, delta, p: SparseAttentionProblem, limit: int, dq,
                 use_hopper: bool | None = None):
    """Writes ``dq``'s rows whose tiles' unions hold more than ``limit`` blocks (the walk left
    them), window by window: the partials from the Gluon kernel on a Hopper GPU where it takes
    the inputs, else from the Triton one."""
    hard, work, arguments, constants = _hard_work(p, limit)
    segments = work.segments.shape[0]
    part_dtype = _dq_part_dtype(p, q)
    rows, windows, window_hard, bounds = _windows(p, part_dtype.itemsize * p.head_dim, hard,
                                                  work)
    dq_part = torch.empty(rows * p.num_index_heads * p.top_k * p.gq, p.head_dim,
                          dtype=part_dtype, device=q.device)
    ids = _block_ids(p)
    hopper = _use_hopper(use_hopper, sm90_key_outer.supported(q, k, v, p, dout))
    descriptors = sm90_key_outer.block_descriptors(k, v, p.block_size) if hopper else None
    for window, (start, end) in enumerate(windows):
        if hopper:
            sm90_key_outer.launch_key_outer(q, descriptors, window_hard, window, bounds,
                                            dq_part, None, arguments, start, segments,
                                            constants, p.scale * LOG2_E, dout=dout, lse=lse,
                                            delta=delta)
        else:
            launch(_dq_key_outer_kernel, (segments,),
                   q, k, v, dout, lse, delta, window_hard, window, bounds, bounds.shape[1],
                   dq_part, *arguments, start, *strides(q, k, v, dout), p.scale * LOG2_E,
                   **constants, **KEY_OUTER_CONFIG)
        _sum_dq_window(ids, hard, window_hard, window, dq_part, dq, start, end, p)
    return dq


@triton.jit
def _segment_hard_kernel(SEGMENT_HARD, HARD, SEGMENTS, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT,
                         HI: tl.constexpr, SEGMENT_PAIRS: tl.constexpr,
                         PAIRS_PAD: tl.constexpr):
    """SEGMENT_HARD[segment] = 1 where a pair of the segment has a hard row, else 0."""
    segment = tl.program_id(0).to(tl.int64)
    bucket = tl.load(SEGMENTS + 2 * segment)
    first = tl.load(SEGMENTS + 2 * segment + 1)
    valid_bucket = tl.maximum(bucket, 0)
    bucket_end = tl.load(BUCKET_START + valid_bucket) + tl.load(BUCKET_COUNT + valid_bucket)
    last = tl.where(bucket < 0, first, tl.minimum(first + SEGMENT_PAIRS, bucket_end))
    pairs = first + tl.arange(0, PAIRS_PAD)
    valid = pairs < last
    token = tl.load(PAIR_TOKEN + pairs, mask=valid, other=0).to(tl.int64)
    hard = tl.load(HARD + token * HI + valid_bucket % HI, mask=valid, other=0)
    tl.store(SEGMENT_HARD + segment, tl.max(hard, axis=0).to(tl.int32))


def segment_hard(p: SparseAttentionProblem, hard: torch.Tensor) -> torch.Tensor:
    """int32 per segment of ``p``'s key-block list: 1 where the segment holds a pair of a row
    set in ``hard`` (int8 [Tq, Hi])."""
    work = p.block_work
    segments = work.segments.shape[0]
    flags = torch.empty(segments, dtype=torch.int32, device=hard.device)
    _segment_hard_kernel[(segments,)](
        flags, hard, work.segments, work.pair_token, work.bucket_start, work.bucket_count,
        HI=p.num_index_heads, SEGMENT_PAIRS=work.segment_pairs,
        PAIRS_PAD=triton.next_power_of_2(work.segment_pairs))
    return flags


def hard_atomic_bytes(p: SparseAttentionProblem) -> int:
    """The bytes of ``dkdv_with_hard_atomic_dq``'s fp32 dQ sum: [Tq, H, D]."""
    return p.total * p.num_heads * p.head_dim * 4


def dkdv_with_hard_atomic_dq(q, k, v, dout, lse, delta, p: SparseAttentionProblem,
                             limit: int, dq, dkdv_parts, atomic_dkdv_parts):
    """dk and dv (as ``attention_dkdv``), and ``dq``'s rows whose tiles' unions hold more than
    ``limit`` blocks (the walk left them) from the dK/dV pass: the segments holding a pair of
    such a row run through ``atomic_dkdv_parts(dq_sum, hard, segment_hard, parts)`` (the
    Triton kernel adding those rows' ``dS K`` atomically into an fp32 sum, zeroed at those
    rows alone), the others through ``dkdv_parts(skip, parts)`` (the dK/dV dispatch's kernel,
    leaving the flagged segments); then the sum, scaled and cast, fills the hard rows of dq.
    ``delta`` must hold every row's (the walk's dQ writes them)."""
    dq_sum = torch.empty(p.total, p.num_heads, p.head_dim, dtype=torch.float32,
                         device=q.device)
    hard = hard_rows(p, limit, dq_sum=dq_sum)
    flags = segment_hard(p, hard)
    parts = new_dkdv_parts(q, p)
    dkdv_parts(skip=flags, parts=parts)
    atomic_dkdv_parts(dq_sum=dq_sum, hard=hard, segment_hard=flags, parts=parts)
    dq_from_sum(dq_sum, dq, p, hard=hard)
    return (dq,) + reduce_dkdv_parts(*parts, k, v, p)
