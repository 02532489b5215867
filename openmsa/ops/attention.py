"""Sparse main attention over the kept blocks (SPEC section 3, steps 5-6), forward and backward,
and the KL that trains the index branch.

Each token brings only ``GQ = H / Hi`` query rows (the main heads of its index head), too few for
the tensor cores, so rows are stacked from several tokens:

- Forward and dQ are query-outer: a program takes ``TOK`` consecutive tokens x ``GQ`` heads
  (~128 MMA rows) of one index head and walks the distinct blocks those tokens kept, flash-
  attention style; each row only sees the blocks its own token kept. Neighbouring tokens of a
  trained index branch keep nearly the same blocks, so the walk is close to ``top_k`` blocks.
- dK and dV are key-outer: a program takes one key block and up to ``segment_pairs()`` of the
  (token, index head) pairs that kept it (a key-block -> queries list built on the device,
  ``openmsa.ops.csr``), ``TOK x GQ`` rows at a time, and writes fp32 partials that a small kernel
  sums per block in a fixed order (no atomics: deterministic).

The KL: the forward walk also computes the index log-sum-exp over the kept tokens (without a
running maximum when selection gives each row's largest score). A key-outer kernel over the
dK/dV segments then rebuilds the teacher (the mean of the GQ heads' probabilities, from the final
main log-sum-exps) and the student, and gives the KL's value (ordered partials) and, by atomic
adds, d index_q and d index_k; with ``deterministic`` a query-outer walk gives d index_q and the
value instead, and d index_k comes from ordered partials.
Both gradients are (s - t) times the index keys or queries, scaled by the upstream gradient of
kl, a scalar: they do not depend on dout, so the forward computes them along with the value.

On Hopper GPUs the forward's main branch and dQ run on Gluon kernels instead
(``openmsa.ops.hopper``: the same programs with asynchronous tensor-core products), where they
support the inputs.

Log-sum-exps are kept in base 2 of the scaled scores (``lse2 = log2 sum 2^(c * log2(e) * q.k)``),
so ``P = 2^(c * log2(e) * q.k - lse2)``; the natural-log LSE is ``lse2 * ln 2``.
See docs/KERNELS.md for the design, the alternatives measured and the figures.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from . import hopper
from .csr import (MAX_TILE_TOKENS, BlockWork, QueryTileWork, build_block_work,
                  build_causal_block_work, build_query_tile_work)

LOG2_E = math.log2(math.e)


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
def _token_rows_t(TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr, input_dtype):
    """[ROWS, TOKP] 0/1 matrix: entry (row, t) is 1 when head-major ``row`` belongs to token t;
    fp16 for 16-bit inputs (see _teacher_t), fp32 for fp32 ones."""
    dtype = tl.float32 if input_dtype == tl.float32 else tl.float16
    return (tl.arange(0, ROWS)[:, None] % TOK == tl.arange(0, TOKP)[None, :]).to(dtype)


@triton.jit
def _teacher_t(probs_t, token_rows_t, GQ: tl.constexpr, PRECISION: tl.constexpr):
    """The teacher [BLOCK, TOKP] from the masked main probabilities [BLOCK, ROWS]: each token's
    GQ head rows summed by one MMA against the 0/1 matrix, over GQ. The probabilities enter the
    MMA as fp16: 11 significant bits (bf16 has 8), and in [0, 1] fp16 only loses values under
    6e-8."""
    return tl.dot(probs_t.to(token_rows_t.dtype), token_rows_t, input_precision=PRECISION) / GQ


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
def _sparse_attn_fwd_kernel(
    Q, K, V, IQ, IK, OUT, LSE, LSE_INDEX, INDEX_MAX, SCHEDULE, UNION, UNION_MEMBERS,
    UNION_COUNT, CU_SEQLENS, query_start, query_end,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, stride_iq_t, stride_iq_h, stride_ik_t, stride_ik_h,
    scale_log2, index_scale,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    UNION_SLOTS: tl.constexpr, WITH_MAIN: tl.constexpr, WITH_INDEX: tl.constexpr,
    INDEX_MAX_GIVEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Query-outer forward: one program per (query tile, index head) walks the distinct blocks
    its tokens kept (flash-attention online softmax); a row sees a block only if its own token
    kept it. WITH_MAIN: writes out and lse2 directly (no partials); WITH_INDEX, also the index
    branch's log-sum-exp over the kept tokens (natural log), which the KL needs (alone, without
    WITH_MAIN, next to the Hopper kernel's main branch). INDEX_MAX_GIVEN: each token's largest
    kept index score is INDEX_MAX (selection's), so the index sum needs no running maximum: its
    terms add up elementwise and are reduced once, after the walk."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:  # padding entry
        return
    (seq_start, seq_len, first_position, all_members, row_valid, row_token, row_position,
     row_head, tok_valid, tok_token, tok_position) = _query_tile(
        SCHEDULE, CU_SEQLENS, entry, index_head, query_start, query_end, GQ, TOK, TOKP, ROWS)
    kv_head = index_head // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    if WITH_MAIN:
        q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                    + dims[None, :], mask=row_valid[:, None], other=0.0)  # [ROWS, D]
    if WITH_INDEX:
        index_q = _load_rows(IQ, tok_token, tok_valid, index_head, stride_iq_t, stride_iq_h,
                             INDEX_DIM)  # [TOKP, Di]
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    index_max = tl.full((TOKP,), float("-inf"), tl.float32)
    index_sum = tl.zeros((TOKP,), tl.float32)
    if INDEX_MAX_GIVEN:
        index_max = tl.load(INDEX_MAX + tok_token * HI + index_head, mask=tok_valid, other=0.0)
        index_terms = tl.zeros((TOKP, BLOCK), tl.float32)
    blocks, members_of, walk_length = _walk_list(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                                 index_head, HI, UNION_SLOTS)
    for u in range(0, walk_length):
        block, members, needs_mask = _walk_block(blocks, members_of, u, first_position,
                                                 all_members, BLOCK)
        key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
        row_member, tok_member = _members(members, row_valid, tok_valid, TOK, TOKP, ROWS)
        if WITH_MAIN:
            k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
            v = _load_rows(V, key_token, key_valid, kv_head, stride_v_t, stride_v_h, HEAD_DIM)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            if needs_mask:
                visible = (row_member[:, None] & key_valid[None, :]
                           & (key_pos[None, :] <= row_position[:, None]))
                scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp2(running_max - safe_max)
            probs = tl.exp2(scores - safe_max[:, None])
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None],
                         input_precision=PRECISION)
            running_max = new_max
        if WITH_INDEX:
            ik = _load_rows(IK, key_token, key_valid, index_head // INDEX_GROUP, stride_ik_t,
                            stride_ik_h, INDEX_DIM)
            z = tl.dot(index_q, tl.trans(ik), input_precision=PRECISION) * index_scale
            tok_visible = (tok_member[:, None] & key_valid[None, :]
                           & (key_pos[None, :] <= tok_position[:, None]))
            if INDEX_MAX_GIVEN:
                # Padding rows (tokens TOK.., or not queries) add garbage that is never stored.
                terms = tl.exp(z - index_max[:, None])
                if block * BLOCK + BLOCK > first_position:  # the tile's own block(s)
                    terms = tl.where(tok_visible, terms, 0.0)
                elif needs_mask:  # before the tile only whole tokens drop out: a select per row
                    terms = tl.where(tok_member[:, None], terms, 0.0)
                index_terms += terms
            else:
                z = tl.where(tok_visible, z, float("-inf"))
                new_index_max = tl.maximum(index_max, tl.max(z, axis=1))
                safe_index_max = tl.where(new_index_max == float("-inf"), 0.0, new_index_max)
                index_sum = (index_sum * tl.exp(index_max - safe_index_max)
                             + tl.sum(tl.exp(z - safe_index_max[:, None]), axis=1))
                index_max = new_index_max
    if WITH_MAIN:
        running_sum = tl.where(row_valid, running_sum, 1.0)
        tl.store(OUT + row_token[:, None] * stride_o_t + row_head[:, None] * stride_o_h
                 + dims[None, :], (acc / running_sum[:, None]).to(OUT.dtype.element_ty),
                 mask=row_valid[:, None])
        tl.store(LSE + row_token * (HI * GQ) + row_head, running_max + tl.log2(running_sum),
                 mask=row_valid)
    if WITH_INDEX:
        if INDEX_MAX_GIVEN:
            index_sum = tl.sum(index_terms, axis=1)
        index_sum = tl.where(tok_valid, index_sum, 1.0)
        tl.store(LSE_INDEX + tok_token * HI + index_head, index_max + tl.log(index_sum),
                 mask=tok_valid)


@triton.jit
def _kl_query_kernel(
    Q, K, IQ, IK, LSE, LSE_INDEX, KL_ROWS, DIQ, SCHEDULE, UNION, UNION_MEMBERS, UNION_COUNT, CU_SEQLENS,
    query_start, query_end,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_iq_t, stride_iq_h,
    stride_ik_t, stride_ik_h, scale_log2, index_scale,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    UNION_SLOTS: tl.constexpr, WITH_VALUE: tl.constexpr, WITH_GRAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The KL's query side, from the final log-sum-exps: the forward's walk, recomputing the
    main probabilities for the teacher t and the index scores for the student s. WITH_VALUE:
    KL(t || s) of every (token, index head); WITH_GRAD: sum over kept keys of (s - t) index_k,
    the KL gradient of index_q before its scalar factor (it does not depend on dout, so the
    forward can compute it). Products are transposed (keys as MMA rows) so that the teacher,
    the sum of each token's GQ head rows, is one MMA with the probabilities in registers."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:
        return
    (seq_start, seq_len, first_position, all_members, row_valid, row_token, row_position,
     row_head, tok_valid, tok_token, tok_position) = _query_tile(
        SCHEDULE, CU_SEQLENS, entry, index_head, query_start, query_end, GQ, TOK, TOKP, ROWS)
    kv_head = index_head // KV_GROUP
    q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                + tl.arange(0, HEAD_DIM)[None, :], mask=row_valid[:, None], other=0.0)
    # +inf for padding rows: their probabilities come out 0, as the teacher needs.
    lse = tl.load(LSE + row_token * (HI * GQ) + row_head, mask=row_valid, other=float("inf"))
    index_q = _load_rows(IQ, tok_token, tok_valid, index_head, stride_iq_t, stride_iq_h,
                         INDEX_DIM)  # [TOKP, Di]
    lse_index = tl.load(LSE_INDEX + tok_token * HI + index_head, mask=tok_valid, other=0.0)
    token_rows_t = _token_rows_t(TOK, TOKP, ROWS, Q.dtype.element_ty)
    kl = tl.zeros((TOKP,), tl.float32)
    d_index_q = tl.zeros((TOKP, INDEX_DIM), tl.float32)
    blocks, members_of, walk_length = _walk_list(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                                 index_head, HI, UNION_SLOTS)
    for u in range(0, walk_length):
        block, members, needs_mask = _walk_block(blocks, members_of, u, first_position,
                                                 all_members, BLOCK)
        key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
        k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
        ik = _load_rows(IK, key_token, key_valid, index_head // INDEX_GROUP, stride_ik_t,
                        stride_ik_h, INDEX_DIM)
        row_member, tok_member = _members(members, row_valid, tok_valid, TOK, TOKP, ROWS)
        scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2
        probs_t = tl.exp2(scores_t - lse[None, :])  # [BLOCK, ROWS]
        if needs_mask:
            visible_t = (row_member[None, :] & key_valid[:, None]
                         & (key_pos[:, None] <= row_position[None, :]))
            probs_t = tl.where(visible_t, probs_t, 0.0)
        teacher_t = _teacher_t(probs_t, token_rows_t, GQ, PRECISION)
        log_student_t = (tl.dot(ik, tl.trans(index_q), input_precision=PRECISION) * index_scale
                         - lse_index[None, :])  # [BLOCK, TOKP]
        if WITH_VALUE:
            terms = teacher_t * (tl.log(tl.maximum(teacher_t, 1e-30)) - log_student_t)
            kl += tl.sum(tl.where(teacher_t > 0, terms, 0.0), axis=0)
        if WITH_GRAD:
            tok_visible_t = (tok_member[None, :] & key_valid[:, None]
                             & (key_pos[:, None] <= tok_position[None, :]))
            # (s - t) lies in [-1, 1]; its tiny factor is applied in the backward, so the
            # 16-bit MMA operand keeps its precision.
            dz_t = tl.where(tok_visible_t, tl.exp(log_student_t), 0.0) - teacher_t
            d_index_q = tl.dot(tl.trans(dz_t).to(ik.dtype), ik, d_index_q,
                               input_precision=PRECISION)
    if WITH_VALUE:
        tl.store(KL_ROWS + tok_token * HI + index_head, kl, mask=tok_valid)
    if WITH_GRAD:
        tl.store(DIQ + (tok_token * HI + index_head)[:, None] * INDEX_DIM
                 + tl.arange(0, INDEX_DIM)[None, :], d_index_q, mask=tok_valid[:, None])


@triton.jit
def _sparse_attn_dq_kernel(
    Q, K, V, DOUT, LSE, DELTA, DQ, SCHEDULE, UNION, UNION_MEMBERS, UNION_COUNT, CU_SEQLENS,
    query_start, query_end,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, stride_dq_t, stride_dq_h, scale, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    UNION_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Query-outer dQ: the forward's walk with the three backward products."""
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
def _delta_kernel(OUT, DOUT, DELTA, stride_o_t, stride_o_h, stride_do_t, stride_do_h,
                  NUM_ROWS, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr):
    """DELTA[t, h] = sum_d dO * O (fp32), the softmax-backward correction; rows are (t, h)."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    valid = row < NUM_ROWS
    token, head = row // NUM_HEADS, row % NUM_HEADS
    dims = tl.arange(0, HEAD_DIM)
    out = tl.load(OUT + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
                  mask=valid[:, None], other=0.0).to(tl.float32)
    dout = tl.load(DOUT + token[:, None] * stride_do_t + head[:, None] * stride_do_h
                   + dims[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + row, tl.sum(out * dout, axis=1), mask=valid)


@triton.jit
def _segment(SEGMENTS, SEGMENT_ORDER, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL,
             CU_SEQLENS, query_start, HI: tl.constexpr, SEGMENT_PAIRS: tl.constexpr):
    """This program's segment of a key-block -> queries list: (segment, its pairs [first, last),
    index head, local block, sequence start and length, and the query row of the sequence's
    position 0: pairs name query rows, packed token - query_start); segment -1 is padding."""
    segment = tl.load(SEGMENT_ORDER + tl.program_id(0)).to(tl.int64)
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


@triton.jit
def _pair_rows(PAIR_TOKEN, first_pair, last, GQ: tl.constexpr, GQ_PAD: tl.constexpr,
               TOK: tl.constexpr):
    """Packed token and validity of each head-major row (row = g * TOK + t) for the TOK pairs
    from ``first_pair``. The TOK tokens are loaded once and broadcast over the heads (a load per
    row measured 25% slower in dK/dV)."""
    pairs = tl.arange(0, TOK)
    pair_valid = first_pair + pairs < last
    pair_token = tl.load(PAIR_TOKEN + first_pair + pairs, mask=pair_valid, other=0).to(tl.int64)
    row_token = tl.reshape(tl.broadcast_to(pair_token[None, :], (GQ_PAD, TOK)), (GQ_PAD * TOK,))
    row_valid = tl.reshape(tl.broadcast_to(pair_valid[None, :], (GQ_PAD, TOK)), (GQ_PAD * TOK,))
    return row_token, row_valid & (tl.arange(0, GQ_PAD * TOK) // TOK < GQ)


@triton.jit
def _sparse_attn_dkdv_kernel(
    Q, K, V, DOUT, LSE, DELTA, DK_PART, DV_PART,
    SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
    BLOCK_LOCAL, CU_SEQLENS, query_start,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    SEGMENT_PAIRS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Key-outer dK, dV of one segment: up to SEGMENT_PAIRS (token, index head) pairs that kept
    one key block, TOK pairs x GQ heads (head-major rows) per step; segments run in
    SEGMENT_ORDER (csr.SEGMENT_ORDERS). Writes fp32 partials (dK unscaled)."""
    segment, first, last, index_head, block, seq_start, seq_len, query_base = _segment(
        SEGMENTS, SEGMENT_ORDER, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL,
        CU_SEQLENS, query_start, HI, SEGMENT_PAIRS)
    if segment < 0:
        return
    kv_head = index_head // KV_GROUP
    key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
    k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
    v = _load_rows(V, key_token, key_valid, kv_head, stride_v_t, stride_v_h, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    dk = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    rows = tl.arange(0, ROWS)
    row_head = index_head * GQ + rows // TOK
    for first_pair in range(first, last, TOK):
        row_token, row_valid = _pair_rows(PAIR_TOKEN, first_pair, last, GQ, GQ_PAD, TOK)
        q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                    + dims[None, :], mask=row_valid[:, None], other=0.0)  # [ROWS, D]
        dout = tl.load(DOUT + row_token[:, None] * stride_do_t + row_head[:, None] * stride_do_h
                       + dims[None, :], mask=row_valid[:, None], other=0.0)
        lse = tl.load(LSE + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
        delta = tl.load(DELTA + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
        # Transposed products keep the block's keys as the MMA's M dimension.
        scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2
        probs_t = tl.exp2(scores_t - lse[None, :])  # [BLOCK, ROWS]
        # Padding rows (q = dO = 0) add nothing; only queries inside the block (the first
        # pairs: token order) need the causal mask.
        if tl.load(PAIR_TOKEN + first_pair) - query_base < block * BLOCK + BLOCK - 1:
            query_pos = row_token - query_base
            probs_t = tl.where(row_valid[None, :] & (key_pos[:, None] <= query_pos[None, :]),
                               probs_t, 0.0)
        dv = tl.dot(probs_t.to(dout.dtype), dout, dv, input_precision=PRECISION)
        dprobs_t = tl.dot(v, tl.trans(dout), input_precision=PRECISION)
        dscores_t = probs_t * (dprobs_t - delta[None, :])  # d loss / d (scaled logits)
        dk = tl.dot(dscores_t.to(q.dtype), q, dk, input_precision=PRECISION)
    offsets = (segment * BLOCK + tl.arange(0, BLOCK))[:, None] * HEAD_DIM + dims[None, :]
    tl.store(DK_PART + offsets, dk)
    tl.store(DV_PART + offsets, dv)


@triton.jit
def _kl_kernel(
    Q, K, IQ, IK, LSE, LSE_INDEX, DIK, KL_PARTS, DIQ,
    SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
    BLOCK_LOCAL, CU_SEQLENS, query_start,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_iq_t, stride_iq_h,
    stride_ik_t, stride_ik_h, scale_log2, index_scale,
    HI: tl.constexpr, GQ: tl.constexpr, KV_GROUP: tl.constexpr, INDEX_GROUP: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    INDEX_DIM: tl.constexpr, SEGMENT_PAIRS: tl.constexpr, QUERY_SIDE: tl.constexpr,
    WITH_VALUE: tl.constexpr, PRECISION: tl.constexpr,
):
    """The KL of one segment of the key-block -> queries list (up to SEGMENT_PAIRS (token,
    index head) pairs that kept one key block), PAIRS pairs per step. Per step the teacher
    [BLOCK, PAIRS] is the mean over the index head's GQ main heads of their probabilities, one
    QK^T and its exponentials per head added up in registers, and the student comes from the
    index scores. Always: sum over the pairs of (s - t)^T index_q, the KL gradient of index_k
    before its scalar factor, into DIK: fp32 partials per segment (summed in order afterwards),
    or with QUERY_SIDE added into d index_k's fp32 rows. QUERY_SIDE: also each pair's
    (s - t) index_k into the unscaled gradient of index_q; both by atomic adds (not bitwise
    reproducible: they land in any order), and, with WITH_VALUE, the program's terms of
    KL(t || s), summed in order, into KL_PARTS[program] (0 for padding): one pass gives the
    whole KL."""
    segment, first, last, index_head, block, seq_start, seq_len, query_base = _segment(
        SEGMENTS, SEGMENT_ORDER, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL,
        CU_SEQLENS, query_start, HI, SEGMENT_PAIRS)
    if segment < 0:
        if QUERY_SIDE and WITH_VALUE:
            tl.store(KL_PARTS + tl.program_id(0), 0.0)
        return
    key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
    k = _load_rows(K, key_token, key_valid, index_head // KV_GROUP, stride_k_t, stride_k_h,
                   HEAD_DIM)
    ik = _load_rows(IK, key_token, key_valid, index_head // INDEX_GROUP, stride_ik_t,
                    stride_ik_h, INDEX_DIM)
    dims = tl.arange(0, HEAD_DIM)
    index_dims = tl.arange(0, INDEX_DIM)
    d_index_k = tl.zeros((BLOCK, INDEX_DIM), tl.float32)
    value_keys = tl.zeros((BLOCK,), tl.float32)
    for first_pair in range(first, last, PAIRS):
        pair_valid = first_pair + tl.arange(0, PAIRS) < last
        # int32 rows (fewer live registers; tokens x Hi < 2^31 is checked on the host), int64
        # only inside the addresses.
        token = tl.load(PAIR_TOKEN + first_pair + tl.arange(0, PAIRS), mask=pair_valid, other=0)
        teacher_t = tl.zeros((BLOCK, PAIRS), tl.float32)
        for g in range(GQ):
            head = index_head * GQ + g
            q = tl.load(Q + token[:, None].to(tl.int64) * stride_q_t + head * stride_q_h
                        + dims[None, :], mask=pair_valid[:, None], other=0.0)  # [PAIRS, D]
            # +inf for padding pairs: their probabilities come out 0, as the teacher needs.
            lse = tl.load(LSE + token.to(tl.int64) * (HI * GQ) + head, mask=pair_valid,
                          other=float("inf"))
            teacher_t += tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2
                                 - lse[None, :])
        query_pos = token - query_base.to(tl.int32)
        # Only pairs inside the block (the first ones: token order) need the causal mask.
        if tl.load(PAIR_TOKEN + first_pair) - query_base < block * BLOCK + BLOCK - 1:
            teacher_t = tl.where(key_pos[:, None] <= query_pos[None, :], teacher_t, 0.0)
        teacher_t = teacher_t / GQ
        row = token * HI + index_head.to(tl.int32)  # of the query-side tensors
        index_q = tl.load(IQ + token[:, None].to(tl.int64) * stride_iq_t
                          + index_head * stride_iq_h + index_dims[None, :],
                          mask=pair_valid[:, None], other=0.0)  # [PAIRS, Di]
        lse_index = tl.load(LSE_INDEX + row, mask=pair_valid, other=0.0)
        log_student_t = (tl.dot(ik, tl.trans(index_q), input_precision=PRECISION) * index_scale
                         - lse_index[None, :])  # [BLOCK, PAIRS]
        if QUERY_SIDE and WITH_VALUE:
            terms = teacher_t * (tl.log(tl.maximum(teacher_t, 1e-30)) - log_student_t)
            value_keys += tl.sum(tl.where(teacher_t > 0, terms, 0.0), axis=1)
        # (s - t) lies in [-1, 1]; its tiny factor is applied in the backward, so the 16-bit
        # MMA operand keeps its precision. Made last, so the teacher and the student's scores
        # are dead before the gradient products (fewer live registers).
        visible_t = pair_valid[None, :] & (key_pos[:, None] <= query_pos[None, :])
        dz_t = (tl.where(visible_t, tl.exp(log_student_t), 0.0) - teacher_t).to(index_q.dtype)
        if QUERY_SIDE:
            d_index_q = tl.dot(tl.trans(dz_t), ik, input_precision=PRECISION)
            tl.atomic_add(DIQ + row[:, None].to(tl.int64) * INDEX_DIM + index_dims[None, :],
                          d_index_q, mask=pair_valid[:, None], sem="relaxed")
        d_index_k = tl.dot(dz_t, index_q, d_index_k, input_precision=PRECISION)
    if QUERY_SIDE:
        index_key_heads: tl.constexpr = HI // INDEX_GROUP
        tl.atomic_add(DIK + (key_token * index_key_heads + index_head // INDEX_GROUP)[:, None]
                      * INDEX_DIM + index_dims[None, :], d_index_k, mask=key_valid[:, None],
                      sem="relaxed")
    else:
        tl.store(DIK + (segment * BLOCK + tl.arange(0, BLOCK))[:, None] * INDEX_DIM
                 + index_dims[None, :], d_index_k)
    if QUERY_SIDE and WITH_VALUE:
        tl.store(KL_PARTS + tl.program_id(0), tl.sum(value_keys, axis=0))


@triton.jit
def _reduce_segments_kernel(
    PART, OUT, PART_B, OUT_B, BUCKET_SEGMENTS_END, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
    stride_t, stride_h, stride_b_t, stride_b_h, scale, scale_b, HI: tl.constexpr,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, KEYS: tl.constexpr,
):
    """KEYS keys of one (key block, output head) of dK, dV or d index_k: ``scale`` x the sum, in
    order, of the partials of the segments of its GROUP index heads (contiguous buckets). The
    programs past the first BLOCK // KEYS along axis 2 do the same for PART_B into OUT_B (same
    shape) with ``scale_b``: dK and dV in one launch."""
    global_block = tl.program_id(0).to(tl.int64)
    out_head = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    if chunk >= BLOCK // KEYS:
        PART, OUT, scale, chunk = PART_B, OUT_B, scale_b, chunk - BLOCK // KEYS
        stride_t, stride_h = stride_b_t, stride_b_h
    sequence = tl.load(BLOCK_SEQUENCE + global_block).to(tl.int64)
    if sequence < 0:
        return
    block = tl.load(BLOCK_LOCAL + global_block).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    first_bucket = global_block * HI + out_head * GROUP
    first_segment = tl.load(BUCKET_SEGMENTS_END + first_bucket - 1, mask=first_bucket > 0,
                            other=0).to(tl.int64)
    end_segment = tl.load(BUCKET_SEGMENTS_END + first_bucket + GROUP - 1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    keys = chunk * KEYS + tl.arange(0, KEYS)
    acc = tl.zeros((KEYS, HEAD_DIM), tl.float32)
    for segment in range(first_segment, end_segment):
        acc += tl.load(PART + (segment * BLOCK + keys)[:, None] * HEAD_DIM + dims[None, :])
    key_pos = block * BLOCK + keys.to(tl.int64)
    tl.store(OUT + (seq_start + key_pos)[:, None] * stride_t + out_head * stride_h
             + dims[None, :], (acc * scale).to(OUT.dtype.element_ty),
             mask=(key_pos < seq_len)[:, None])


@triton.jit
def _scale_gradients_kernel(GRAD_A, OUT_A, size_a, GRAD_B, OUT_B, size_b, KL_GRAD, scale,
                            CHUNK: tl.constexpr):
    """OUT = GRAD * (KL_GRAD * scale) in OUT's dtype, for two tensors in one launch: the first
    cdiv(size_a, CHUNK) programs take A, the others B."""
    programs_a = tl.cdiv(size_a, CHUNK)
    on_a = tl.program_id(0) < programs_a
    program = tl.where(on_a, tl.program_id(0), tl.program_id(0) - programs_a).to(tl.int64)
    index = program * CHUNK + tl.arange(0, CHUNK)
    factor = tl.load(KL_GRAD).to(tl.float32) * scale
    if on_a:
        valid = index < size_a
        grad = tl.load(GRAD_A + index, mask=valid)
        tl.store(OUT_A + index, (grad * factor).to(OUT_A.dtype.element_ty), mask=valid)
    else:
        valid = index < size_b
        grad = tl.load(GRAD_B + index, mask=valid)
        tl.store(OUT_B + index, (grad * factor).to(OUT_B.dtype.element_ty), mask=valid)


def scaled_kl_gradients(d_index_q, d_index_k, kl_grad, p: "SparseAttentionProblem", dtype_q,
                        dtype_k):
    """The KL's gradients of index_q and index_k in the given dtypes: the unscaled fp32 ones
    (contiguous) times ``kl_grad * p.kl_gradient_scale()``, in one launch without a host
    synchronization (``kl_grad``: a 0-dim tensor on their device)."""
    out_q = torch.empty(d_index_q.shape, dtype=dtype_q, device=d_index_q.device)
    out_k = torch.empty(d_index_k.shape, dtype=dtype_k, device=d_index_k.device)
    chunk = 4096
    programs = triton.cdiv(d_index_q.numel(), chunk) + triton.cdiv(d_index_k.numel(), chunk)
    if programs:
        _scale_gradients_kernel[(programs,)](
            d_index_q, out_q, d_index_q.numel(), d_index_k, out_k, d_index_k.numel(), kl_grad,
            p.kl_gradient_scale(), CHUNK=chunk, num_warps=4)
    return out_q, out_k


def _precision(tensor) -> str:
    """fp32 inputs keep full precision in the MMAs (no TF32); 16-bit inputs are exact anyway."""
    return "ieee" if tensor.dtype == torch.float32 else "tf32"


def query_tile_shape(gq: int) -> tuple[int, int, int]:
    """(tokens, padded heads, MMA rows) of the query-outer kernels' tiles."""
    return _tile_shape(gq, QUERY_ROWS)


def _tile_shape(gq: int, target_rows: int) -> tuple[int, int, int]:
    """(tokens per tile, padded heads, MMA rows) for ``gq`` heads per token: a power-of-two
    token count with about ``target_rows`` rows, and at least 16 rows; at most
    MAX_TILE_TOKENS tokens (the bits of a block's members mask)."""
    heads = triton.next_power_of_2(gq)
    tokens = max(1, target_rows // heads)
    tokens = 1 << (tokens.bit_length() - 1)
    tokens = min(max(tokens, 16 // min(heads, 16)), MAX_TILE_TOKENS)
    return tokens, heads, heads * tokens


# Launch configurations (H200). The main kernels' are the winners of
# benchmarks/bench_attention.py's sweep; stage counts are the most that fit in shared memory
# (227 KiB) at D = Di = 128 without register spills (benchmarks/inspect_kernels.py prints both).
FWD_CONFIG = dict(num_warps=8, num_stages=2)
DQ_CONFIG = dict(num_warps=8, num_stages=2)
DKDV_CONFIG = dict(num_warps=8, num_stages=2)
KL_QUERY_CONFIG = dict(num_warps=8, num_stages=2)
KL_CONFIG = dict(num_warps=8, num_stages=2)
# The index log-sum-exp alone (next to the Hopper forward: index_log_sum_exp). On the main
# tiles' 8 tokens (128k, H64, H200) 4 warps beat 8 and 2 (3.65 against 4.15 and 3.78 ms), 2
# stages beat 1, 3 and 4; on its own 32-token tiles 4 warps and 2 stages stay the best (0.198 ms
# at 16k, H16, 1.518 at 128k; benchmarks/results/step-16k-h200-2026-11-30/lists-second/).
INDEX_ALONE_CONFIG = dict(num_warps=4, num_stages=2)
# Its tiles hold at least this many tokens: every block a tile walks costs one [block, Di] load
# of index keys whatever its token count, and neighbouring tokens mostly keep the same blocks.
# The main tiles hold 128 / GQ tokens: on their 8 at GQ = 16 it took 3.66 ms at 128k, on 32
# tokens 1.49 (H200). At 16k, H16 64 tokens took 0.139 ms against 0.200 on 32, their own lists
# 0.038 against none (the main tiles' 32 tokens served); 64 is the most a tile's members mask
# holds. Measurements of this and SEGMENT_PAIRS: benchmarks/results/
# segments-index-tiles-h200-2026-11-30/.
INDEX_TILE_TOKENS = 64
KL_PAIRS = 64  # pairs per step of the key-outer KL kernel (the teacher is [block, KL_PAIRS])
# Pairs per key-outer program (dK/dV, the KL): bounds a program's work when many queries keep
# the same block. H200, against 2048: dK/dV with its reduction 1.229 against 1.281 ms at 16k,
# H16, 9.21 against 9.72 at 32k, H64 and 37.5 against 38.9 at 128k; the KL 0.869 against
# 0.851, 4.48 against 4.63 and 18.0 against 18.0.
SEGMENT_PAIRS = 1024
# From this many (token, index head, slot) entries on (256k tokens at Hi = 4, top_k = 16)
# segments hold LONG_SEGMENT_PAIRS: each segment's fp32 dK and dV partials take 128 KiB (at
# D = 128, blocks of 128), and at 1M tokens 2048-pair segments keep them to at most 8 GiB
# instead of 12.
LONG_SEGMENTS_MIN_PAIRS = 1 << 24
LONG_SEGMENT_PAIRS = 2048
QUERY_ROWS = 128  # MMA rows of a query tile (forward, dQ, KL query side)
REDUCE_KEYS = 32  # keys per program of the segment reductions
# Top-k selections run the key-outer segments by query row (their queries then come from L2)
# once there are this many segments' worth of pairs per SM, and most pairs first below (the
# longest segments then do not start last). H200, with 2048-pair segments: by rows 4-8% faster
# at 32k and 128k tokens with H = 64 (7.8 and 31 per SM), 3-4% slower at 16k with H = 16 (3.9
# per SM). With 1024-pair segments, 16k at H = 16 has 7.8 per SM and by rows its dK/dV took
# 1.175 ms against 1.243 (the KL 0.869 against 0.863).
ROWS_ORDER_MIN_SEGMENTS_PER_SM = 6


def segment_pairs(num_queries: int, num_index_heads: int, slots: int) -> int:
    """Pairs per key-outer segment for the (token, index head, slot) entries of a problem."""
    if num_queries * num_index_heads * slots >= LONG_SEGMENTS_MIN_PAIRS:
        return LONG_SEGMENT_PAIRS
    return SEGMENT_PAIRS


class SparseAttentionProblem:
    """Shapes, constants and device-built work lists shared by the forward and the backward.

    ``index_k``, ``index_scale`` (None: main attention only, no KL) describe the index branch.
    The queries (q and the query-side tensors, ``[Tq, ...]``) are the packed tokens
    ``[query_start, query_start + Tq)`` of the packing of k (``[T, ...]``) and ``cu_seqlens``;
    by default all of them. The KL is a mean over ``kl_num_queries`` query tokens (default Tq).
    ``all_causal``: ``block_ids`` keep every causal block (warmup), so the key-block list is
    built directly, without sorting them.
    """

    def __init__(self, q, k, block_ids, cu_seqlens, block_size, softmax_scale, index_k=None,
                 index_scale=None, query_rows=QUERY_ROWS, key_rows=64,
                 query_work: QueryTileWork | None = None, block_work: BlockWork | None = None,
                 query_start: int = 0, kl_num_queries: int | None = None,
                 all_causal: bool = False):
        self.total, self.num_heads, self.head_dim = q.shape
        self.num_keys, self.num_kv_heads = k.shape[0], k.shape[1]
        self.query_start = query_start
        self.kl_num_queries = self.total if kl_num_queries is None else kl_num_queries
        self.num_index_heads, self.top_k = block_ids.shape[1], block_ids.shape[2]
        self.gq = self.num_heads // self.num_index_heads
        self.with_index = index_k is not None
        self.index_dim = index_k.shape[2] if self.with_index else 16
        self.index_group = self.num_index_heads // index_k.shape[1] if self.with_index else 1
        self.index_scale = index_scale if self.with_index else 0.0
        self.block_size = block_size
        self.scale = softmax_scale
        self.block_ids = block_ids
        self.cu_seqlens = cu_seqlens
        self.query_tokens, gq_pad, self.query_rows = _tile_shape(self.gq, query_rows)
        self.key_tokens, _, self.key_rows = _tile_shape(self.gq, key_rows)
        # Given when the forward built it already (the custom operator's backward).
        self.query_work: QueryTileWork = query_work or build_query_tile_work(
            block_ids, cu_seqlens, self.query_tokens, query_start)
        self.shared = dict(HI=self.num_index_heads, GQ=self.gq, GQ_PAD=gq_pad,
                           KV_GROUP=self.num_index_heads // self.num_kv_heads,
                           INDEX_GROUP=self.index_group, BLOCK=block_size,
                           HEAD_DIM=self.head_dim, INDEX_DIM=self.index_dim,
                           PRECISION=_precision(q))
        self.all_causal = all_causal
        if block_work is not None:  # given when the forward built it already
            self.block_work = block_work

    @functools.cached_property
    def index_tile_work(self) -> QueryTileWork:
        """The index log-sum-exp's walk lists when it runs alone (``index_log_sum_exp``): tiles
        of INDEX_TILE_TOKENS tokens, or the main tiles when those are as wide."""
        if self.query_tokens >= INDEX_TILE_TOKENS:
            return self.query_work
        return build_query_tile_work(self.block_ids, self.cu_seqlens, INDEX_TILE_TOKENS,
                                     self.query_start)

    @functools.cached_property
    def block_work(self) -> BlockWork:
        """The key-block -> queries list (dK/dV and the KL): built on first use."""
        pairs = segment_pairs(self.total, self.num_index_heads, self.top_k)
        if self.all_causal:
            return build_causal_block_work(self.cu_seqlens, self.total, self.num_index_heads,
                                           self.block_size, self.top_k, pairs,
                                           self.query_start, self.num_keys, "head_rows")
        return build_block_work(self.block_ids, self.cu_seqlens, self.block_size, pairs,
                                self.query_start, self.num_keys,
                                self._top_k_segment_order(pairs))

    def _top_k_segment_order(self, pairs_per_segment: int) -> str:
        """``build_block_work``'s segment order for this problem's size on its device."""
        device = self.block_ids.device
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 1)
        pairs = self.total * self.num_index_heads * self.top_k
        return ("rows" if pairs >= ROWS_ORDER_MIN_SEGMENTS_PER_SM * pairs_per_segment * sms
                else "pairs")

    def query_constants(self):
        return dict(self.shared, TOK=self.query_tokens, TOKP=max(16, self.query_tokens),
                    ROWS=self.query_rows, UNION_SLOTS=self.query_work.union.shape[-1])

    def key_constants(self, tokens, rows):
        return dict(self.shared, TOK=tokens, TOKP=max(16, tokens), ROWS=rows,
                    SEGMENT_PAIRS=self.block_work.segment_pairs)

    def kl_constants(self, pairs):
        shared = {name: self.shared[name] for name in ("HI", "GQ", "KV_GROUP", "INDEX_GROUP",
                                                       "BLOCK", "HEAD_DIM", "INDEX_DIM",
                                                       "PRECISION")}
        return dict(shared, PAIRS=pairs, SEGMENT_PAIRS=self.block_work.segment_pairs)

    def query_grid(self):
        return (self.query_work.schedule.shape[0], self.num_index_heads)

    def query_work_args(self):
        work = self.query_work
        return (work.schedule, work.union, work.union_members, work.union_count,
                self.cu_seqlens, self.query_start, self.query_start + self.total)

    def key_work_args(self):
        work = self.block_work
        return (work.segments, work.segment_order, work.pair_token, work.bucket_start,
                work.bucket_count, work.block_sequence, work.block_local, self.cu_seqlens,
                self.query_start)

    def kl_mean(self, kl_parts):
        """The KL from its terms summed in parts (per (token, index head) or per key-outer
        program): their sum over Nq * Hi, with Nq = ``kl_num_queries``."""
        return kl_parts.sum() / (self.kl_num_queries * self.num_index_heads)

    def kl_gradient_scale(self) -> float:
        """d kl / d z = (s - t) * kl_grad * this, kl_grad being the gradient reaching kl: 1 /
        (Nq * Hi), times the index scale for the chain rule through
        z = index_scale * index_q . index_k."""
        return self.index_scale / (self.kl_num_queries * self.num_index_heads)


def _strides(*tensors):
    return [stride for t in tensors for stride in (t.stride(0), t.stride(1))]


# Configurations whose pipeline stages did not fit this GPU's shared memory (small GQ with wide
# head dims: a tile of 64 tokens carries a 64-row index query), remembered so that they are not
# compiled again.
_ONE_STAGE: set = set()


def _launch(kernel, grid, *args, num_warps, num_stages, **constants):
    """``kernel[grid](...)``, falling back to one pipeline stage (the same kernel without
    overlapped loads) when ``num_stages`` exceeds the shared memory; other errors propagate."""
    key = (kernel.fn.__name__, num_warps, tuple(sorted(constants.items())))
    if num_stages > 1 and key not in _ONE_STAGE:
        try:
            return kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constants)
        except OutOfResources:
            _ONE_STAGE.add(key)
    return kernel[grid](*args, num_warps=num_warps, num_stages=1, **constants)


def sparse_attention_fwd(q, k, v, index_q, index_k, p: SparseAttentionProblem,
                         index_max=None, num_warps=None, num_stages=None,
                         use_hopper: bool | None = None):
    """q [T, H, D], k, v [T, Hkv, D] (index_q [T, Hi, Di], index_k [T, Hik, Di] or None).
    Returns out [T, H, D] (q's dtype), lse2 [T, H] and the index log-sum-exp [T, Hi] (natural
    log over the kept tokens; None without the index branch), both fp32. ``index_max``: fp32
    [T, Hi], each row's largest index score over its kept tokens when known (selection's
    largest block score, when selection keeps the best block), or None.
    On a Hopper GPU the main branch runs on the Gluon kernel (``openmsa.ops.hopper``) where it
    supports the inputs, else on the Triton kernel; ``use_hopper=False`` forces the Triton
    kernel (benchmarks compare the two). ``num_warps``, ``num_stages``: the Triton launch's
    (default FWD_CONFIG)."""
    given = p.with_index and index_max is not None
    # The Hopper kernel has no index branch: with one, it runs next to the Triton kernel's
    # index part alone (when selection gives the row maxima; else the Triton kernel does all).
    if (use_hopper is not False and (given or not p.with_index)
            and hopper.supported(q, k, v, p)):
        out, lse = hopper.sparse_attention_fwd(q, k, v, p, p.scale * LOG2_E)
        if not p.with_index:
            return out, lse, None
        return out, lse, index_log_sum_exp(index_q, index_k, index_max, p)
    out = torch.empty_like(q)
    lse = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
    lse_index = (torch.empty(p.total, p.num_index_heads, dtype=torch.float32, device=q.device)
                 if p.with_index else lse)
    iq, ik = (index_q, index_k) if p.with_index else (q, k)  # unused placeholders otherwise
    _launch(_sparse_attn_fwd_kernel, p.query_grid(),
        q, k, v, iq, ik, out, lse, lse_index, index_max if given else lse,
        *p.query_work_args(), *_strides(q, k, v, out, iq, ik), p.scale * LOG2_E, p.index_scale,
        **p.query_constants(), WITH_MAIN=True, WITH_INDEX=p.with_index,
        INDEX_MAX_GIVEN=given, num_warps=num_warps or FWD_CONFIG["num_warps"],
        num_stages=num_stages or FWD_CONFIG["num_stages"])
    return out, lse, (lse_index if p.with_index else None)


def index_log_sum_exp(index_q, index_k, index_max, p: SparseAttentionProblem):
    """The index log-sum-exp over the kept tokens alone (natural log, fp32 [T, Hi]), given each
    row's largest kept index score ``index_max`` (selection's): the forward's index part on
    the tiles of ``p.index_tile_work``."""
    work = p.index_tile_work
    lse_index = torch.empty(p.total, p.num_index_heads, dtype=torch.float32,
                            device=index_q.device)
    tokens = work.tile_tokens
    padded = max(16, tokens)
    # Without the main branch the kernel reads no q, k, v, out or lse: index tensors stand in.
    _launch(_sparse_attn_fwd_kernel, (work.schedule.shape[0], p.num_index_heads),
        index_q, index_k, index_k, index_q, index_k, index_q, lse_index, lse_index, index_max,
        work.schedule, work.union, work.union_members, work.union_count, p.cu_seqlens,
        p.query_start, p.query_start + p.total,
        *_strides(index_q, index_k, index_k, index_q, index_q, index_k), 0.0, p.index_scale,
        **dict(p.query_constants(), TOK=tokens, TOKP=padded, ROWS=padded,
               UNION_SLOTS=work.union.shape[-1]),
        WITH_MAIN=False, WITH_INDEX=True, INDEX_MAX_GIVEN=True, **INDEX_ALONE_CONFIG)
    return lse_index


def kl_query_side(q, k, index_q, index_k, lse, lse_index, p: SparseAttentionProblem,
                  with_value: bool, with_grad: bool, num_warps=KL_QUERY_CONFIG["num_warps"],
                  num_stages=KL_QUERY_CONFIG["num_stages"]):
    """The KL's query-side walk. Returns the KL of every (token, index head), fp32 [T, Hi]
    (None unless ``with_value``), and, unless ``with_grad`` is False, the unscaled KL gradient
    of index_q, fp32 [T, Hi, Di]: the gradient is ``kl_grad * p.kl_gradient_scale()`` times it."""
    rows = torch.empty(p.total, p.num_index_heads, dtype=torch.float32, device=q.device)
    d_index_q = (torch.empty(p.total, p.num_index_heads, p.index_dim, dtype=torch.float32,
                             device=q.device) if with_grad else rows)
    _launch(_kl_query_kernel, p.query_grid(),
        q, k, index_q, index_k, lse, lse_index, rows, d_index_q, *p.query_work_args(),
        *_strides(q, k, index_q, index_k), p.scale * LOG2_E, p.index_scale,
        **p.query_constants(), WITH_VALUE=with_value, WITH_GRAD=with_grad,
        num_warps=num_warps, num_stages=num_stages)
    return (rows if with_value else None), (d_index_q if with_grad else None)


def attention_delta(out, dout, p: SparseAttentionProblem):
    """[T, H] fp32: sum_d dO * O per (token, head)."""
    delta = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=out.device)
    rows = 64 if out.is_cuda else 1024  # the interpreter's cost is per program
    _delta_kernel[(triton.cdiv(p.total * p.num_heads, rows),)](
        out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
        p.total * p.num_heads, NUM_HEADS=p.num_heads, HEAD_DIM=p.head_dim, ROWS=rows)
    return delta


def _hopper_dq(q, k, v, dout, p: SparseAttentionProblem, use_hopper: bool | None) -> bool:
    """Whether dq runs on the Gluon kernel."""
    return use_hopper is not False and hopper.supported(q, k, v, p) and dout.stride(2) == 1


def attention_dq(q, k, v, dout, lse, delta, p: SparseAttentionProblem,
                 num_warps=DQ_CONFIG["num_warps"], num_stages=DQ_CONFIG["num_stages"],
                 use_hopper: bool | None = None):
    """dq, query-outer: on a Hopper GPU the Gluon kernel (``openmsa.ops.hopper``) where it
    supports the inputs, else (or with ``use_hopper=False``) the Triton kernel."""
    if _hopper_dq(q, k, v, dout, p, use_hopper):
        return hopper.attention_dq(q, k, v, dout, lse, delta, p, p.scale * LOG2_E)
    dq = torch.empty_like(q)
    _launch(_sparse_attn_dq_kernel, p.query_grid(),
        q, k, v, dout, lse, delta, dq, *p.query_work_args(), *_strides(q, k, v, dout, dq),
        p.scale, p.scale * LOG2_E, **p.query_constants(), num_warps=num_warps,
        num_stages=num_stages)
    return dq


def attention_backward(q, k, v, out, dout, lse, p: SparseAttentionProblem,
                       use_hopper: bool | None = None):
    """dq, dk, dv of the main attention: delta, the query-outer dQ, the key-outer dK/dV. The
    Gluon dQ computes the deltas itself (one pass over out and dout less)."""
    dout = dout.contiguous()
    if _hopper_dq(q, k, v, dout, p, use_hopper) and out.stride(2) == 1:
        delta = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
        dq = hopper.attention_dq(q, k, v, dout, lse, delta, p, p.scale * LOG2_E, out=out)
    else:
        delta = attention_delta(out, dout, p)
        dq = attention_dq(q, k, v, dout, lse, delta, p, use_hopper=use_hopper)
    return (dq,) + attention_dkdv(q, k, v, dout, lse, delta, p, use_hopper=use_hopper)


def _reduce_segments(part, out, scale, group, p: SparseAttentionProblem, part_b=None,
                     out_b=None, scale_b=1.0):
    """Sums the per-segment partials of every (key block, output head) into ``out`` (and, in
    the same launch, ``part_b``'s into ``out_b``, a tensor like ``out``)."""
    blocks = p.block_work
    # A program per REDUCE_KEYS keys of a (key block, head): with whole blocks, 16k tokens at
    # 2 KV heads made 258 programs, and each reduction took 37 us on an H200.
    keys = min(REDUCE_KEYS, p.block_size)
    paired = part_b is not None
    part_b, out_b = (part_b, out_b) if paired else (part, out)
    _reduce_segments_kernel[(blocks.num_global_blocks, out.shape[1],
                             (2 if paired else 1) * (p.block_size // keys))](
        part, out, part_b, out_b, blocks.bucket_segments_end, blocks.block_sequence,
        blocks.block_local, p.cu_seqlens, *_strides(out, out_b), scale, scale_b,
        HI=p.num_index_heads, GROUP=group, BLOCK=p.block_size, HEAD_DIM=out.shape[2],
        KEYS=keys, num_warps=4)
    return (out, out_b) if paired else out


def attention_dkdv(q, k, v, dout, lse, delta, p: SparseAttentionProblem,
                   num_warps=DKDV_CONFIG["num_warps"], num_stages=DKDV_CONFIG["num_stages"],
                   use_hopper: bool | None = None):
    """dk, dv, key-outer: fp32 partials per segment of pairs, then an in-order sum per key
    block. The partials come from the Gluon kernel on a Hopper GPU where it supports the inputs
    (unless ``use_hopper=False``), else from the Triton kernel."""
    if use_hopper is not False and hopper.supported_key_outer(q, k, v, dout, p):
        dk_part, dv_part = hopper.attention_dkdv_parts(q, k, v, dout, lse, delta, p,
                                                       p.scale * LOG2_E)
    else:
        segments = p.block_work.segments.shape[0]
        dk_part, dv_part = (torch.empty(segments * p.block_size, p.head_dim,
                                        dtype=torch.float32, device=q.device)
                            for _ in range(2))
        _launch(_sparse_attn_dkdv_kernel, (segments,),
            q, k, v, dout, lse, delta, dk_part, dv_part, *p.key_work_args(),
            *_strides(q, k, v, dout), p.scale * LOG2_E,
            **p.key_constants(p.key_tokens, p.key_rows), num_warps=num_warps,
            num_stages=num_stages)
    return _reduce_segments(dk_part, torch.empty_like(k), p.scale, p.shared["KV_GROUP"], p,
                            dv_part, torch.empty_like(v), 1.0)


def kl_key_walk(q, k, index_q, index_k, lse, lse_index, p: SparseAttentionProblem,
                query_side: bool, with_value: bool, pairs=None,
                num_warps=KL_CONFIG["num_warps"], num_stages=KL_CONFIG["num_stages"],
                use_hopper: bool | None = None):
    """The key-outer KL kernel over the key-block -> queries list (on a Hopper GPU the Gluon
    kernel where it supports the inputs; else, with ``use_hopper=False`` or with ``pairs`` and
    the launch options, which tune it, the Triton kernel).
    Returns the unscaled KL gradient of index_k (fp32, index_k's shape; per-segment partials
    summed in order, or with ``query_side`` atomic adds) and, with ``query_side``, the KL's
    terms summed per program (fp32 [segments]: their sum over Nq * Hi is the KL; None unless
    ``with_value``) and the unscaled gradient of index_q (fp32 [T, Hi, Di], summed by atomic
    adds). The gradients are ``kl_grad * p.kl_gradient_scale()`` times the unscaled ones."""
    segments = p.block_work.segments.shape[0]
    if query_side:  # both gradients by atomic adds
        d_index_q = torch.zeros(p.total, p.num_index_heads, p.index_dim, dtype=torch.float32,
                                device=q.device)
        d_index_k = torch.zeros(index_k.shape, dtype=torch.float32, device=q.device)
    else:  # d index_k's partials per segment, summed in order below
        d_index_k = torch.empty(segments * p.block_size, p.index_dim, dtype=torch.float32,
                                device=q.device)
        d_index_q = d_index_k  # a placeholder
    value_parts = (torch.empty(segments, dtype=torch.float32, device=q.device)
                   if query_side and with_value else d_index_k)  # (else a placeholder)
    if (use_hopper is not False and pairs is None
            and hopper.supported_kl(q, k, index_q, index_k, p)):
        hopper.kl_key_walk_parts(q, k, index_q, index_k, lse, lse_index, p, d_index_k,
                                 value_parts, d_index_q, query_side, with_value,
                                 p.scale * LOG2_E, KL_PAIRS)
    else:
        _launch(_kl_kernel, (segments,),
            q, k, index_q, index_k, lse, lse_index, d_index_k, value_parts, d_index_q,
            *p.key_work_args(),
            *_strides(q, k, index_q, index_k), p.scale * LOG2_E, p.index_scale,
            **p.kl_constants(pairs or KL_PAIRS), QUERY_SIDE=query_side, WITH_VALUE=with_value,
            num_warps=num_warps, num_stages=num_stages)
    if not query_side:
        return _reduce_segments(d_index_k, torch.empty(index_k.shape, dtype=torch.float32,
                                                       device=q.device),
                                1.0, p.index_group, p), None, None
    return d_index_k, (value_parts if with_value else None), d_index_q


def index_branch_kl(q, k, index_q, index_k, lse, lse_index, p: SparseAttentionProblem,
                    with_value: bool, with_grad: bool, deterministic: bool):
    """The KL from the final log-sum-exps: (its terms summed in parts, per (token, index
    head) or per key-outer program, whose sum over Nq * Hi is the KL (``p.kl_mean``), or None
    unless ``with_value``; the unscaled gradients of index_q and index_k or None unless
    ``with_grad``).

    The gradients come from one key-outer pass (``kl_key_walk``) that sums them by atomic adds;
    ``deterministic`` instead takes d index_q and the value from the query-side walk, a second
    pass over the same pairs that writes each (token, index head) once, and d index_k from the
    key-outer pass's ordered partials. The value alone is the query-side walk, which needs no
    key-block list."""
    if not with_grad:
        value_parts, _ = kl_query_side(q, k, index_q, index_k, lse, lse_index, p,
                                       with_value=True, with_grad=False)
        return value_parts, None, None
    if deterministic:
        value_parts, d_index_q = kl_query_side(q, k, index_q, index_k, lse, lse_index, p,
                                               with_value=with_value, with_grad=True)
        d_index_k, _, _ = kl_key_walk(q, k, index_q, index_k, lse, lse_index, p,
                                      query_side=False, with_value=False)
        return value_parts, d_index_q, d_index_k
    d_index_k, value_parts, d_index_q = kl_key_walk(q, k, index_q, index_k, lse, lse_index,
                                                    p, query_side=True, with_value=with_value)
    return value_parts, d_index_q, d_index_k


class SparseAttentionFunction(torch.autograd.Function):
    """Autograd of the main attention alone over given kept blocks (``sparse_attention``):
    q [T, H, D]; k, v [T, Hkv, D]; block_ids int32 [T, Hi, k] token-major. ``msa_attention``,
    with the index branch and the KL, runs through the custom operators of
    ``openmsa.ops.library``."""

    @staticmethod
    def forward(ctx, q, k, v, block_ids, cu_seqlens, block_size, softmax_scale):
        problem = SparseAttentionProblem(q, k, block_ids, cu_seqlens, block_size, softmax_scale)
        out, lse, _ = sparse_attention_fwd(q, k, v, None, None, problem)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return attention_backward(q, k, v, out, dout, lse, ctx.problem) + (None,) * 4
