"""The main attention's backward on Triton kernels: the deltas (rowsum dO * O), dQ
query-outer over the tile unions (as the forward), dK and dV key-outer.

dK and dV: a program takes one key block and a segment of the (token, index head) pairs that
kept it (``worklists.key_blocks``), ``TOK x GQ`` rows at a time, and writes fp32 partials that
``segments.reduce_segments`` sums per block in a fixed order: no atomics, deterministic.
With ``ATOMIC_DQ`` (``Tuning.dq_pass = "dkdv_atomic"``) each step also adds its rows' dQ over
the block, ``dS K``, atomically into an fp32 sum: no dQ walk, a cost that follows the kept
pairs, but an order of additions that varies from run to run. With ``HARD_ROWS_DQ``
(``Tuning.dq_pass = "hard_atomic"``) only the rows the dQ walk leaves (``key_outer.hard_rows``)
are added, and one launch runs only the segments that hold such a row (the others run on the
plain kernel, which skips them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import DKDV_ATOMIC_DQ_ROWS, DKDV_CONFIG, DQ_CONFIG
from ..launch import launch, strides
from ..problem import LOG2_E, SparseAttentionProblem, _tile_shape
from ..segments import reduce_segments
from ..tiles import (_block_keys, _load_rows, _members, _query_tile, _segment,
                     _walk_block, _walk_list)


@triton.jit
def _sparse_attn_dq_kernel(
    Q, K, V, DOUT, LSE, DELTA, DQ, SCHEDULE, UNION, UNION_MEMBERS, UNION_COUNT, CU_SEQLENS,
    query_start, query_end,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, stride_dq_t, stride_dq_h, scale, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    UNION_SLOTS: tl.constexpr, PRECISION: tl.constexpr, WALK_LIMIT: tl.constexpr = 0,
):
    """Query-outer dQ: the forward's walk with the three backward products. WALK_LIMIT > 0:
    a tile whose union holds more blocks leaves its rows to the key-outer dQ."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:
        return
    (seq_start, seq_len, first_position, all_members, row_valid, row_token, row_position,
     row_head, tok_valid, tok_token, tok_position) = _query_tile(
        SCHEDULE, CU_SEQLENS, entry, index_head, query_start, query_end, GQ, TOK, TOKP, ROWS)
    kv_head = index_head // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                + dims[None, :], mask=row_valid[:, None], other=0.0)
    dout = tl.load(DOUT + row_token[:, None] * stride_do_t + row_head[:, None] * stride_do_h
                   + dims[None, :], mask=row_valid[:, None], other=0.0)
    lse = tl.load(LSE + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
    delta = tl.load(DELTA + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
    dq = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    blocks, members_of, walk_length = _walk_list(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                                 index_head, HI, UNION_SLOTS)
    if WALK_LIMIT > 0:
        if walk_length > WALK_LIMIT:
            return
    for u in range(0, walk_length):
        block, members, needs_mask = _walk_block(blocks, members_of, u, first_position,
                                                 all_members, BLOCK)
        key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
        k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
        v = _load_rows(V, key_token, key_valid, kv_head, stride_v_t, stride_v_h, HEAD_DIM)
        row_member, tok_member = _members(members, row_valid, tok_valid, TOK, TOKP, ROWS)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        probs = tl.exp2(scores - lse[:, None])
        if needs_mask:
            visible = (row_member[:, None] & key_valid[None, :]
                       & (key_pos[None, :] <= row_position[:, None]))
            probs = tl.where(visible, probs, 0.0)
        dprobs = tl.dot(dout, tl.trans(v), input_precision=PRECISION)
        dscores = probs * (dprobs - delta[:, None])
        dq = tl.dot(dscores.to(k.dtype), k, dq, input_precision=PRECISION)
    tl.store(DQ + row_token[:, None] * stride_dq_t + row_head[:, None] * stride_dq_h
             + dims[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_valid[:, None])


@triton.jit
def _delta_kernel(OUT, DOUT, DELTA, DQ_SUM, stride_o_t, stride_o_h, stride_do_t, stride_do_h,
                  NUM_ROWS, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                  ZERO_DQ_SUM: tl.constexpr = False):
    """DELTA[t, h] = sum_d dO * O (fp32), the softmax-backward correction; rows are (t, h).
    ZERO_DQ_SUM: also zeroes the rows of DQ_SUM [Tq * H, D] (fp32), saving a launch."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    valid = row < NUM_ROWS
    token, head = row // NUM_HEADS, row % NUM_HEADS
    dims = tl.arange(0, HEAD_DIM)
    out = tl.load(OUT + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
                  mask=valid[:, None], other=0.0).to(tl.float32)
    dout = tl.load(DOUT + token[:, None] * stride_do_t + head[:, None] * stride_do_h
                   + dims[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + row, tl.sum(out * dout, axis=1), mask=valid)
    if ZERO_DQ_SUM:
        tl.store(DQ_SUM + row[:, None] * HEAD_DIM + dims[None, :],
                 tl.zeros((ROWS, HEAD_DIM), tl.float32), mask=valid[:, None])


@triton.jit
def _dq_from_sum_kernel(DQ_SUM, DQ, HARD, stride_dq_t, stride_dq_h, scale, NUM_ROWS,
                        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                        GQ: tl.constexpr = 1, HARD_ROWS: tl.constexpr = False):
    """DQ[t, h] = scale * DQ_SUM[t, h] in DQ's dtype: the atomic sums scaled and cast in one
    pass; rows are (t, h). HARD_ROWS: only the rows whose (t, index head h // GQ) is set in
    HARD [Tq, H / GQ] (int8; the walk wrote the others)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    valid = row < NUM_ROWS
    token, head = row // NUM_HEADS, row % NUM_HEADS
    if HARD_ROWS:
        valid &= tl.load(HARD + token * (NUM_HEADS // GQ) + head // GQ, mask=valid,
                         other=0) != 0
    dims = tl.arange(0, HEAD_DIM)
    total = tl.load(DQ_SUM + row[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None],
                    other=0.0)
    tl.store(DQ + token[:, None] * stride_dq_t + head[:, None] * stride_dq_h + dims[None, :],
             (total * scale).to(DQ.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _pair_rows(PAIR_TOKEN, first_pair, last, GQ: tl.constexpr, GQ_PAD: tl.constexpr,
               TOK: tl.constexpr):
    """Packed token and validity of each head-major row (row = g * TOK + t) for the TOK pairs
    from ``first_pair``, and the pairs' own tokens and validity. The TOK tokens are loaded once
    and broadcast over the heads (a load per row is slower)."""
    pairs = tl.arange(0, TOK)
    pair_valid = first_pair + pairs < last
    pair_token = tl.load(PAIR_TOKEN + first_pair + pairs, mask=pair_valid, other=0).to(tl.int64)
    row_token = _over_heads(pair_token, GQ_PAD, TOK)
    row_valid = _over_heads(pair_valid, GQ_PAD, TOK)
    return (row_token, row_valid & (tl.arange(0, GQ_PAD * TOK) // TOK < GQ), pair_token,
            pair_valid)


@triton.jit
def _over_heads(per_pair, GQ_PAD: tl.constexpr, TOK: tl.constexpr):
    """A per-pair vector [TOK] repeated for each head: head-major rows [GQ_PAD * TOK]."""
    return tl.reshape(tl.broadcast_to(per_pair[None, :], (GQ_PAD, TOK)), (GQ_PAD * TOK,))


@triton.jit
def _dkdv_steps(dk, dv, k, v, key_pos, Q, DOUT, LSE, DELTA, PAIR_TOKEN, first, last, block,
                index_head, query_base, stride_q_t, stride_q_h, stride_do_t, stride_do_h,
                scale_log2, DQ_SUM, TEACHER, HARD, HI: tl.constexpr, GQ: tl.constexpr,
                GQ_PAD: tl.constexpr, TOK: tl.constexpr, ROWS: tl.constexpr,
                BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
                ATOMIC_DQ: tl.constexpr, STORE_TEACHER: tl.constexpr,
                HARD_ROWS_DQ: tl.constexpr = False):
    """dK and dV of the block over the pairs [first, last), TOK pairs x GQ heads (head-major
    rows) a step, added to ``dk`` and ``dv``.
    ATOMIC_DQ: every row's ``dS K`` is added atomically to its row of DQ_SUM [Tq, H, D]
    (fp32, unscaled); with HARD_ROWS_DQ only the rows whose (token, index head) is set in
    HARD [Tq, HI] (int8). STORE_TEACHER: each pair's KL teacher over the block (the mean of its GQ
    heads' probabilities, masked) into TEACHER [pairs, BLOCK] (the KL's ``TEACHER_GIVEN``)."""
    dims = tl.arange(0, HEAD_DIM)
    rows = tl.arange(0, ROWS)
    row_head = index_head * GQ + rows // TOK
    for first_pair in range(first, last, TOK):
        row_token, row_valid, pair_token, pair_valid = _pair_rows(PAIR_TOKEN, first_pair, last,
                                                                  GQ, GQ_PAD, TOK)
        q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                    + dims[None, :], mask=row_valid[:, None], other=0.0)  # [ROWS, D]
        dout = tl.load(DOUT + row_token[:, None] * stride_do_t + row_head[:, None] * stride_do_h
                       + dims[None, :], mask=row_valid[:, None], other=0.0)
        row = row_token * (HI * GQ) + row_head  # of the [Tq, H] tensors
        lse = tl.load(LSE + row, mask=row_valid, other=0.0)
        delta = tl.load(DELTA + row, mask=row_valid, other=0.0)
        # Transposed products keep the block's keys as the MMA's M dimension.
        scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2
        probs_t = tl.exp2(scores_t - lse[None, :])  # [BLOCK, ROWS]
        # Padding rows (q = dO = 0) add nothing; only queries inside the block (the first
        # pairs: token order) need the causal mask.
        if tl.load(PAIR_TOKEN + first_pair) - query_base < block * BLOCK + BLOCK - 1:
            query_pos = row_token - query_base
            probs_t = tl.where(row_valid[None, :] & (key_pos[:, None] <= query_pos[None, :]),
                               probs_t, 0.0)
        if STORE_TEACHER:
            # A sum over the head-major rows' heads (an MMA against a 0/1 matrix, as the KL's
            # query side does it, made ptxas serialize the step's products at 2 stages).
            # Padding rows' probabilities are not 0 (their lse loads as 0): masked first.
            teacher_t = tl.sum(tl.reshape(tl.where(row_valid[None, :], probs_t, 0.0),
                                          (BLOCK, GQ_PAD, TOK)), axis=1) / GQ  # [BLOCK, TOK]
            step_pairs = first_pair + tl.arange(0, TOK)
            tl.store(TEACHER + step_pairs[None, :].to(tl.int64) * BLOCK
                     + tl.arange(0, BLOCK)[:, None], teacher_t.to(TEACHER.dtype.element_ty),
                     mask=(step_pairs < last)[None, :])
        dv = tl.dot(probs_t.to(dout.dtype), dout, dv, input_precision=PRECISION)
        dprobs_t = tl.dot(v, tl.trans(dout), input_precision=PRECISION)
        dscores_t = probs_t * (dprobs_t - delta[None, :])  # d loss / d (scaled logits)
        dk = tl.dot(dscores_t.to(q.dtype), q, dk, input_precision=PRECISION)
        if ATOMIC_DQ:
            # Transposed, [D, ROWS]: shaped [ROWS, D] (M = 32 rows) the product made ptxas
            # serialize the step's asynchronous MMAs at 2 stages. Relaxed atomics: nothing
            # reads the sum before the kernel ends.
            dq_t = tl.dot(tl.trans(k), dscores_t.to(k.dtype), input_precision=PRECISION)
            adds = row_valid
            if HARD_ROWS_DQ:
                pair_hard = tl.load(HARD + pair_token * HI + index_head, mask=pair_valid,
                                    other=0) != 0
                adds &= _over_heads(pair_hard, GQ_PAD, TOK)
            tl.atomic_add(DQ_SUM + row[None, :] * HEAD_DIM + dims[:, None], dq_t,
                          mask=adds[None, :], sem="relaxed")
    return dk, dv


@triton.jit
def _sparse_attn_dkdv_kernel(
    Q, K, V, DOUT, LSE, DELTA, DK_PART, DV_PART,
    SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
    BLOCK_LOCAL, CU_SEQLENS, query_start,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, scale_log2, DQ_SUM, TEACHER, SEGMENT_HARD, HARD,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    SEGMENT_PAIRS: tl.constexpr, PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr = False,
    STORE_TEACHER: tl.constexpr = False, SEGMENTS_RUN: tl.constexpr = 0,
    HARD_ROWS_DQ: tl.constexpr = False,
):
    """Key-outer dK, dV of one segment: up to SEGMENT_PAIRS (token, index head) pairs that kept
    one key block, TOK pairs x GQ heads (head-major rows) per step; segments run in
    SEGMENT_ORDER (worklists.key_blocks.SEGMENT_ORDERS). Writes fp32 partials (dK unscaled).
    ATOMIC_DQ: the rows' dQ over the block is added atomically into DQ_SUM (HARD_ROWS_DQ: the
    rows set in HARD only); STORE_TEACHER: each pair's KL teacher into TEACHER
    (``_dkdv_steps``). SEGMENTS_RUN: 0 every segment, 1 those not flagged in SEGMENT_HARD
    (int32 per segment), 2 the flagged ones only."""
    segment, first, last, index_head, block, seq_start, seq_len, query_base = _segment(
        SEGMENTS, SEGMENT_ORDER, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL,
        CU_SEQLENS, query_start, HI, SEGMENT_PAIRS)
    if segment < 0:
        return
    if SEGMENTS_RUN != 0:
        if (tl.load(SEGMENT_HARD + segment) != 0) != (SEGMENTS_RUN == 2):
            return
    kv_head = index_head // KV_GROUP
    key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
    k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
    v = _load_rows(V, key_token, key_valid, kv_head, stride_v_t, stride_v_h, HEAD_DIM)
    dk = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    dk, dv = _dkdv_steps(dk, dv, k, v, key_pos, Q, DOUT, LSE, DELTA, PAIR_TOKEN, first, last,
                         block, index_head, query_base, stride_q_t, stride_q_h, stride_do_t,
                         stride_do_h, scale_log2, DQ_SUM, TEACHER, HARD, HI, GQ, GQ_PAD, TOK,
                         ROWS, BLOCK, HEAD_DIM, PRECISION, ATOMIC_DQ, STORE_TEACHER,
                         HARD_ROWS_DQ)
    offsets = (segment * BLOCK + tl.arange(0, BLOCK))[:, None] * HEAD_DIM \
        + tl.arange(0, HEAD_DIM)[None, :]
    tl.store(DK_PART + offsets, dk)
    tl.store(DV_PART + offsets, dv)


def _row_programs(p: SparseAttentionProblem, device) -> tuple[int, int]:
    """Rows a program and programs of the kernels over the (token, head) rows."""
    rows = 64 if device.type == "cuda" else 1024  # the interpreter's cost is per program
    return rows, triton.cdiv(p.total * p.num_heads, rows)


def attention_delta(out, dout, p: SparseAttentionProblem, dq_sum=None):
    """[T, H] fp32: sum_d dO * O per (token, head); ``dq_sum`` (fp32 [T, H, D]): zeroed on
    the way."""
    delta = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=out.device)
    rows, programs = _row_programs(p, out.device)
    _delta_kernel[(programs,)](
        out, dout, delta, dq_sum, out.stride(0), out.stride(1), dout.stride(0),
        dout.stride(1), p.total * p.num_heads, NUM_HEADS=p.num_heads, HEAD_DIM=p.head_dim,
        ROWS=rows, ZERO_DQ_SUM=dq_sum is not None)
    return delta


def triton_dq(q, k, v, dout, lse, delta, p: SparseAttentionProblem,
              num_warps=DQ_CONFIG["num_warps"], num_stages=DQ_CONFIG["num_stages"],
              walk_limit: int = 0):
    """dq on the Triton kernel, query-outer (q's dtype); ``walk_limit`` > 0: the rows of
    tiles whose union holds more blocks are left unwritten (key-outer's)."""
    dq = torch.empty_like(q)
    launch(_sparse_attn_dq_kernel, p.query_grid(),
        q, k, v, dout, lse, delta, dq, *p.query_work_args(), *strides(q, k, v, dout, dq),
        p.scale, p.scale * LOG2_E, **p.query_constants(), WALK_LIMIT=walk_limit,
        num_warps=num_warps, num_stages=num_stages)
    return dq


def new_dkdv_parts(q, p: SparseAttentionProblem):
    """Empty fp32 dK and dV partials, [segments * block, D] each."""
    segments = p.block_work.segments.shape[0]
    return tuple(torch.empty(segments * p.block_size, p.head_dim, dtype=torch.float32,
                             device=q.device) for _ in range(2))


def triton_dkdv_parts(q, k, v, dout, lse, delta, p: SparseAttentionProblem,
                      num_warps=DKDV_CONFIG["num_warps"], num_stages=DKDV_CONFIG["num_stages"],
                      dq_sum=None, teacher=None, segment_hard=None, hard_segments_only=False,
                      hard=None, parts=None):
    """fp32 dK (unscaled) and dV partials per segment of ``p``'s key-block list, key-outer.
    ``dq_sum``: an fp32
    [Tq, H, D] tensor that each row's unscaled dQ is atomically added to (in steps of
    ``DKDV_ATOMIC_DQ_ROWS`` rows: the extra product needs the registers), or with ``hard``
    (int8 [Tq, Hi]) only the rows set there; ``teacher``: a [pairs, block] tensor that each
    pair's KL teacher is stored into. ``segment_hard`` (int32 per segment): the segments
    flagged there are left (another launch writes them), or with ``hard_segments_only`` they
    alone run; ``parts``: the (dk, dv) partials to write into (new ones by default)."""
    segments = p.block_work.segments.shape[0]
    dk_part, dv_part = parts or new_dkdv_parts(q, p)
    tokens, rows = p.key_tokens, p.key_rows
    if dq_sum is not None:
        tokens, _, rows = _tile_shape(p.gq, DKDV_ATOMIC_DQ_ROWS)
    segments_run = 0 if segment_hard is None else 2 if hard_segments_only else 1
    launch(_sparse_attn_dkdv_kernel, (segments,),
        q, k, v, dout, lse, delta, dk_part, dv_part, *p.key_work_args(),
        *strides(q, k, v, dout), p.scale * LOG2_E, dq_sum, teacher, segment_hard, hard,
        **p.key_constants(tokens, rows), ATOMIC_DQ=dq_sum is not None,
        STORE_TEACHER=teacher is not None, SEGMENTS_RUN=segments_run,
        HARD_ROWS_DQ=hard is not None, num_warps=num_warps, num_stages=num_stages)
    return dk_part, dv_part


def reduce_dkdv_parts(dk_part, dv_part, k, v, p: SparseAttentionProblem):
    """dk (scaled by the softmax scale) and dv from the per-segment partials, summed per key
    block in segment order."""
    return reduce_segments(dk_part, torch.empty_like(k), p.scale, p.shared["KV_GROUP"], p,
                           dv_part, torch.empty_like(v), 1.0)


def triton_backward_atomic_dq(q, k, v, out, dout, lse, p: SparseAttentionProblem,
                               teacher=None):
    """dq, dk, dv with every row's dQ from the dK/dV pass (``Tuning.dq_pass =
    "dkdv_atomic"``): the deltas, then the Triton dK/dV kernel adding each step's ``dS K``
    atomically into an fp32 sum (zeroed by the deltas' kernel; not bitwise reproducible),
    scaled and cast into dq in one pass. ``teacher``: as ``triton_dkdv_parts``'."""
    dq_sum = torch.empty(p.total, p.num_heads, p.head_dim, dtype=torch.float32,
                         device=q.device)
    delta = attention_delta(out, dout, p, dq_sum=dq_sum)
    dk_part, dv_part = triton_dkdv_parts(q, k, v, dout, lse, delta, p, dq_sum=dq_sum,
                                         teacher=teacher)
    dq = torch.empty_like(q)
    dq_from_sum(dq_sum, dq, p)
    return (dq,) + reduce_dkdv_parts(dk_part, dv_part, k, v, p)


def dq_from_sum(dq_sum, dq, p: SparseAttentionProblem, hard=None) -> None:
    """``dq`` = the softmax scale x ``dq_sum`` (fp32 [Tq, H, D]) in dq's dtype, one pass; with
    ``hard`` (int8 [Tq, Hi]) only the rows of the (token, index head)s set there."""
    rows, programs = _row_programs(p, dq.device)
    _dq_from_sum_kernel[(programs,)](dq_sum, dq, hard, dq.stride(0), dq.stride(1), p.scale,
                                     p.total * p.num_heads, NUM_HEADS=p.num_heads,
                                     HEAD_DIM=p.head_dim, ROWS=rows, GQ=p.gq,
                                     HARD_ROWS=hard is not None)
