"""Sparse main attention over the kept blocks (SPEC section 3, steps 5-6), forward and backward.

Each token brings only ``GQ = H / Hi`` query rows (the main heads of its index head), too few for
the tensor cores, so rows are stacked from several tokens:

- Forward and dQ are query-outer: a program takes ``TOK`` consecutive tokens x ``GQ`` heads
  (~128 MMA rows) of one index head and walks the distinct blocks those tokens kept, flash-
  attention style; each row only sees the blocks its own token kept. Neighbouring tokens of a
  trained index branch keep nearly the same blocks, so the walk is close to ``top_k`` blocks.
- dK and dV are key-outer: a program takes one key block and up to ``SEGMENT_PAIRS`` of the
  (token, index head) pairs that kept it (a key-block -> queries list built on the device,
  ``openmsa.ops.csr``), ``TOK x GQ`` rows at a time, and writes fp32 partials that a small kernel
  sums per block in a fixed order (no atomics: deterministic).

With the index branch, the same walks also compute what the KL needs: the index log-sum-exp over
the kept tokens (forward), d index_q (dQ walk) and d index_k (dK/dV segments), from the teacher
(the mean of the GQ heads' probabilities, which those walks recompute anyway); one more walk
computes the KL's value.

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

from .csr import BlockWork, QueryTileWork, build_block_work, build_query_tile_work

LOG2_E = math.log2(math.e)


@triton.jit
def _query_tile(SCHEDULE, CU_SEQLENS, IDS, entry, index_head, HI: tl.constexpr,
                GQ: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
                TOP_K: tl.constexpr, TOPK_PAD: tl.constexpr, DENSE: tl.constexpr):
    """A (real) query tile: TOK consecutive tokens of one sequence; its MMA rows are the GQ heads
    of ``index_head`` x the tokens, head-major (row = g * TOK + t; rows of heads >= GQ are
    padding).
    Returns the sequence's start and length, the tile's first position, per-row (valid, packed
    token, position, head, kept ids [ROWS, TOPK_PAD]) and per-token rows padded to TOKP (valid,
    packed token, position, kept ids [TOKP, TOPK_PAD]); ids are -1 padded. DENSE (warmup: every
    earlier block kept) loads no ids."""
    sequence = tl.load(SCHEDULE + 2 * entry).to(tl.int64)
    tile = tl.load(SCHEDULE + 2 * entry + 1).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    first_position = tile * TOK
    # Tokens padded to TOKP (>= 16) rows, the M of the index-branch MMAs; rows TOK.. are empty.
    padded = tl.arange(0, TOKP)
    tok_position = first_position + padded
    tok_valid = (padded < TOK) & (tok_position < seq_len)
    tok_token = seq_start + tok_position
    rows = tl.arange(0, ROWS)
    row_position = first_position + rows % TOK
    row_valid = (rows // TOK < GQ) & (row_position < seq_len)
    row_head = index_head * GQ + rows // TOK
    if DENSE:
        tok_ids = tl.full((TOKP, 2), -1, tl.int32)
        row_ids = tl.full((ROWS, 2), -1, tl.int32)
    else:
        slots = tl.arange(0, TOPK_PAD)
        tok_ids = tl.load(IDS + (tok_token * HI + index_head)[:, None] * TOP_K + slots[None, :],
                          mask=tok_valid[:, None] & (slots[None, :] < TOP_K), other=-1)
        row_ids = tl.load(IDS + ((seq_start + row_position) * HI + index_head)[:, None] * TOP_K
                          + slots[None, :], mask=row_valid[:, None] & (slots[None, :] < TOP_K),
                          other=-1)  # [ROWS, TOPK_PAD]
    return (seq_start, seq_len, first_position, row_valid, seq_start + row_position,
            row_position, row_head, row_ids, tok_valid, tok_token, tok_position, tok_ids)


@triton.jit
def _members(row_ids, tok_ids, block, row_valid, tok_valid, DENSE: tl.constexpr):
    """Which rows and tokens kept ``block`` (DENSE: all valid ones; causality is separate)."""
    if DENSE:
        row_member = row_valid
        tok_member = tok_valid
    else:
        row_member = (tl.max((row_ids == block).to(tl.int32), axis=1) > 0) & row_valid
        tok_member = tl.max((tok_ids == block).to(tl.int32), axis=1) > 0
    return row_member, tok_member


@triton.jit
def _token_rows(TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr, dtype):
    """[TOKP, ROWS] 0/1 matrix: entry (t, row) is 1 when head-major ``row`` belongs to token t."""
    return (tl.arange(0, ROWS)[None, :] % TOK == tl.arange(0, TOKP)[:, None]).to(dtype)


@triton.jit
def _split_dot_left(a, b, dtype, PRECISION: tl.constexpr):
    """a @ b for an fp32 ``a`` through 16-bit MMAs (see _split_dot)."""
    high = a.to(dtype)
    low = (a - high.to(tl.float32)).to(dtype)
    return (tl.dot(high, b, input_precision=PRECISION)
            + tl.dot(low, b, input_precision=PRECISION))


@triton.jit
def _split_dot(a, b, dtype, PRECISION: tl.constexpr):
    """a @ b for an fp32 ``b`` through 16-bit MMAs, as b's 16-bit value plus its 16-bit
    remainder (about 16 significant bits instead of 8)."""
    high = b.to(dtype)
    low = (b - high.to(tl.float32)).to(dtype)
    return (tl.dot(a, high, input_precision=PRECISION)
            + tl.dot(a, low, input_precision=PRECISION))


@triton.jit
def _load_block(K, V, IK, seq_start, seq_len, block, kv_head, index_kv_head, stride_k_t,
                stride_k_h, stride_v_t, stride_v_h, stride_ik_t, stride_ik_h,
                BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
                WITH_INDEX: tl.constexpr):
    """Keys [BLOCK, D], values and index keys [BLOCK, Di] (zeros if not WITH_INDEX) of a block."""
    key_pos = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    key_valid = key_pos < seq_len
    dims = tl.arange(0, HEAD_DIM)
    rows = (seq_start + key_pos)[:, None]
    k = tl.load(K + rows * stride_k_t + kv_head * stride_k_h + dims[None, :],
                mask=key_valid[:, None], other=0.0)
    v = tl.load(V + rows * stride_v_t + kv_head * stride_v_h + dims[None, :],
                mask=key_valid[:, None], other=0.0)
    index_dims = tl.arange(0, INDEX_DIM)
    if WITH_INDEX:
        ik = tl.load(IK + rows * stride_ik_t + index_kv_head * stride_ik_h + index_dims[None, :],
                     mask=key_valid[:, None], other=0.0)
    else:
        ik = tl.zeros((BLOCK, INDEX_DIM), K.dtype.element_ty)
    return key_pos, key_valid, k, v, ik


@triton.jit
def _sparse_attn_fwd_kernel(
    Q, K, V, IQ, IK, OUT, LSE, LSE_INDEX, IDS, SCHEDULE, UNION, UNION_COUNT, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, stride_iq_t, stride_iq_h, stride_ik_t, stride_ik_h,
    scale_log2, index_scale,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr, TOP_K: tl.constexpr,
    TOPK_PAD: tl.constexpr, UNION_SLOTS: tl.constexpr, WITH_INDEX: tl.constexpr,
    DENSE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Query-outer forward: one program per (query tile, index head) walks the distinct blocks
    its tokens kept (flash-attention online softmax); a row sees a block only if its own token
    kept it. Writes out and lse2 directly (no partials); WITH_INDEX, also the index branch's
    log-sum-exp over the kept tokens (natural log), which the KL needs."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:  # padding entry
        return
    (seq_start, seq_len, first_position, row_valid, row_token, row_position, row_head, row_ids,
     tok_valid, tok_token, tok_position, tok_ids) = _query_tile(
        SCHEDULE, CU_SEQLENS, IDS, entry, index_head, HI, GQ, TOK, TOKP, ROWS, TOP_K, TOPK_PAD,
        DENSE)
    kv_head = index_head // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                + dims[None, :], mask=row_valid[:, None], other=0.0)  # [ROWS, D]
    index_dims = tl.arange(0, INDEX_DIM)
    if WITH_INDEX:
        index_q = tl.load(IQ + tok_token[:, None] * stride_iq_t + index_head * stride_iq_h
                          + index_dims[None, :], mask=tok_valid[:, None], other=0.0)  # [TOKP, Di]
    else:
        index_q = tl.zeros((TOKP, INDEX_DIM), Q.dtype.element_ty)
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    index_max = tl.full((TOKP,), float("-inf"), tl.float32)
    index_sum = tl.zeros((TOKP,), tl.float32)
    union_base = UNION + (entry * HI + index_head) * UNION_SLOTS
    for u in range(0, tl.load(UNION_COUNT + entry * HI + index_head)):
        block = tl.load(union_base + u).to(tl.int64)
        key_pos, key_valid, k, v, ik = _load_block(
            K, V, IK, seq_start, seq_len, block, kv_head, index_head // INDEX_GROUP, stride_k_t,
            stride_k_h, stride_v_t, stride_v_h, stride_ik_t, stride_ik_h, BLOCK, HEAD_DIM,
            INDEX_DIM, WITH_INDEX)
        row_member, tok_member = _members(row_ids, tok_ids, block, row_valid, tok_valid, DENSE)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        # A block before the tile that every row kept needs no mask.
        if (block * BLOCK + BLOCK > first_position) | (tl.min(row_member.to(tl.int32)) == 0):
            visible = (row_member[:, None] & key_valid[None, :]
                       & (key_pos[None, :] <= row_position[:, None]))
            scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(running_max - safe_max)
        probs = tl.exp2(scores - safe_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
        if WITH_INDEX:
            z = tl.dot(index_q, tl.trans(ik), input_precision=PRECISION) * index_scale
            tok_visible = (tok_member[:, None] & key_valid[None, :]
                           & (key_pos[None, :] <= tok_position[:, None]))
            z = tl.where(tok_visible, z, float("-inf"))
            new_index_max = tl.maximum(index_max, tl.max(z, axis=1))
            safe_index_max = tl.where(new_index_max == float("-inf"), 0.0, new_index_max)
            index_sum = (index_sum * tl.exp(index_max - safe_index_max)
                         + tl.sum(tl.exp(z - safe_index_max[:, None]), axis=1))
            index_max = new_index_max
    running_sum = tl.where(row_valid, running_sum, 1.0)
    tl.store(OUT + row_token[:, None] * stride_o_t + row_head[:, None] * stride_o_h
             + dims[None, :], (acc / running_sum[:, None]).to(OUT.dtype.element_ty),
             mask=row_valid[:, None])
    tl.store(LSE + row_token * (HI * GQ) + row_head, running_max + tl.log2(running_sum),
             mask=row_valid)
    if WITH_INDEX:
        index_sum = tl.where(tok_valid, index_sum, 1.0)
        tl.store(LSE_INDEX + tok_token * HI + index_head, index_max + tl.log(index_sum),
                 mask=tok_valid)


@triton.jit
def _kl_value_kernel(
    Q, K, V, IQ, IK, LSE, LSE_INDEX, KL_ROWS, IDS, SCHEDULE, UNION, UNION_COUNT, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_iq_t, stride_iq_h, stride_ik_t, stride_ik_h, scale_log2, index_scale,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr, TOP_K: tl.constexpr,
    TOPK_PAD: tl.constexpr, UNION_SLOTS: tl.constexpr, DENSE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """KL(teacher || student) of every (token, index head), summed over its kept keys, from the
    final log-sum-exps: the same walk as the forward, recomputing the main probabilities."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:
        return
    (seq_start, seq_len, first_position, row_valid, row_token, row_position, row_head, row_ids,
     tok_valid, tok_token, tok_position, tok_ids) = _query_tile(
        SCHEDULE, CU_SEQLENS, IDS, entry, index_head, HI, GQ, TOK, TOKP, ROWS, TOP_K, TOPK_PAD,
        DENSE)
    kv_head = index_head // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                + dims[None, :], mask=row_valid[:, None], other=0.0)
    lse = tl.load(LSE + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
    index_dims = tl.arange(0, INDEX_DIM)
    index_q = tl.load(IQ + tok_token[:, None] * stride_iq_t + index_head * stride_iq_h
                      + index_dims[None, :], mask=tok_valid[:, None], other=0.0)  # [TOKP, Di]
    lse_index = tl.load(LSE_INDEX + tok_token * HI + index_head, mask=tok_valid, other=0.0)
    token_rows = _token_rows(TOK, TOKP, ROWS, Q.dtype.element_ty)
    kl = tl.zeros((TOKP,), tl.float32)
    union_base = UNION + (entry * HI + index_head) * UNION_SLOTS
    for u in range(0, tl.load(UNION_COUNT + entry * HI + index_head)):
        block = tl.load(union_base + u).to(tl.int64)
        key_pos, key_valid, k, v, ik = _load_block(
            K, V, IK, seq_start, seq_len, block, kv_head, index_head // INDEX_GROUP, stride_k_t,
            stride_k_h, stride_v_t, stride_v_h, stride_ik_t, stride_ik_h, BLOCK, HEAD_DIM,
            INDEX_DIM, True)
        row_member, tok_member = _members(row_ids, tok_ids, block, row_valid, tok_valid, DENSE)
        visible = (row_member[:, None] & key_valid[None, :]
                   & (key_pos[None, :] <= row_position[:, None]))
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        probs = tl.where(visible, tl.exp2(scores - lse[:, None]), 0.0)
        # The teacher, [TOKP, BLOCK]: each token's rows summed by an MMA, over GQ.
        teacher = _split_dot(token_rows, probs, Q.dtype.element_ty, PRECISION) / GQ
        log_student = (tl.dot(index_q, tl.trans(ik), input_precision=PRECISION) * index_scale
                       - lse_index[:, None])
        terms = teacher * (tl.log(tl.maximum(teacher, 1e-30)) - log_student)
        kl += tl.sum(tl.where(teacher > 0, terms, 0.0), axis=1)
    tl.store(KL_ROWS + tok_token * HI + index_head, kl, mask=tok_valid)


@triton.jit
def _sparse_attn_dq_kernel(
    Q, K, V, IQ, IK, DOUT, LSE, DELTA, LSE_INDEX, KL_GRAD, DQ, DIQ, IDS, SCHEDULE, UNION,
    UNION_COUNT, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, stride_dq_t, stride_dq_h, stride_iq_t, stride_iq_h,
    stride_ik_t, stride_ik_h, stride_diq_t, stride_diq_h, scale, scale_log2, index_scale,
    kl_norm,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr, TOP_K: tl.constexpr,
    TOPK_PAD: tl.constexpr, UNION_SLOTS: tl.constexpr, WITH_INDEX: tl.constexpr,
    DENSE: tl.constexpr, PRECISION: tl.constexpr,
):
    """Query-outer dQ, and WITH_INDEX the KL gradient of index_q: the forward's walk; the main
    probabilities it recomputes also give the teacher, d kl / d z = (s - t) / (Nq * Hi)."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:
        return
    (seq_start, seq_len, first_position, row_valid, row_token, row_position, row_head, row_ids,
     tok_valid, tok_token, tok_position, tok_ids) = _query_tile(
        SCHEDULE, CU_SEQLENS, IDS, entry, index_head, HI, GQ, TOK, TOKP, ROWS, TOP_K, TOPK_PAD,
        DENSE)
    kv_head = index_head // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                + dims[None, :], mask=row_valid[:, None], other=0.0)
    dout = tl.load(DOUT + row_token[:, None] * stride_do_t + row_head[:, None] * stride_do_h
                   + dims[None, :], mask=row_valid[:, None], other=0.0)
    lse = tl.load(LSE + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
    delta = tl.load(DELTA + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
    index_dims = tl.arange(0, INDEX_DIM)
    token_rows = _token_rows(TOK, TOKP, ROWS, Q.dtype.element_ty)
    if WITH_INDEX:
        index_q = tl.load(IQ + tok_token[:, None] * stride_iq_t + index_head * stride_iq_h
                          + index_dims[None, :], mask=tok_valid[:, None], other=0.0)
        lse_index = tl.load(LSE_INDEX + tok_token * HI + index_head, mask=tok_valid, other=0.0)
        dz_scale = tl.load(KL_GRAD) * kl_norm * index_scale
    else:
        index_q = tl.zeros((TOKP, INDEX_DIM), Q.dtype.element_ty)
        lse_index = tl.zeros((TOKP,), tl.float32)
        dz_scale = 0.0
    dq = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    d_index_q = tl.zeros((TOKP, INDEX_DIM), tl.float32)
    union_base = UNION + (entry * HI + index_head) * UNION_SLOTS
    for u in range(0, tl.load(UNION_COUNT + entry * HI + index_head)):
        block = tl.load(union_base + u).to(tl.int64)
        key_pos, key_valid, k, v, ik = _load_block(
            K, V, IK, seq_start, seq_len, block, kv_head, index_head // INDEX_GROUP, stride_k_t,
            stride_k_h, stride_v_t, stride_v_h, stride_ik_t, stride_ik_h, BLOCK, HEAD_DIM,
            INDEX_DIM, WITH_INDEX)
        row_member, tok_member = _members(row_ids, tok_ids, block, row_valid, tok_valid, DENSE)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        probs = tl.exp2(scores - lse[:, None])
        if (block * BLOCK + BLOCK > first_position) | (tl.min(row_member.to(tl.int32)) == 0):
            visible = (row_member[:, None] & key_valid[None, :]
                       & (key_pos[None, :] <= row_position[:, None]))
            probs = tl.where(visible, probs, 0.0)
        dprobs = tl.dot(dout, tl.trans(v), input_precision=PRECISION)
        dscores = probs * (dprobs - delta[:, None])
        dq += tl.dot(dscores.to(k.dtype), k, input_precision=PRECISION)
        if WITH_INDEX:
            teacher = _split_dot(token_rows, probs, Q.dtype.element_ty, PRECISION) / GQ
            z = tl.dot(index_q, tl.trans(ik), input_precision=PRECISION) * index_scale
            tok_visible = (tok_member[:, None] & key_valid[None, :]
                           & (key_pos[None, :] <= tok_position[:, None]))
            student = tl.where(tok_visible, tl.exp(z - lse_index[:, None]), 0.0)
            # (s - t) lies in [-1, 1]; the tiny scale waits until the end, so 16-bit operands of
            # the MMA keep their precision.
            dz = student - teacher  # [TOKP, BLOCK], rows TOK.. zero
            d_index_q += tl.dot(dz.to(ik.dtype), ik, input_precision=PRECISION)
    tl.store(DQ + row_token[:, None] * stride_dq_t + row_head[:, None] * stride_dq_h
             + dims[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=row_valid[:, None])
    if WITH_INDEX:
        tl.store(DIQ + tok_token[:, None] * stride_diq_t + index_head * stride_diq_h
                 + index_dims[None, :], (d_index_q * dz_scale).to(DIQ.dtype.element_ty),
                 mask=tok_valid[:, None])


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
def _sparse_attn_dkdv_kernel(
    Q, K, V, IQ, IK, DOUT, LSE, DELTA, LSE_INDEX, KL_GRAD, DK_PART, DV_PART, DIK_PART,
    SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
    BLOCK_LOCAL, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, stride_iq_t, stride_iq_h, stride_ik_t, stride_ik_h,
    scale_log2, index_scale, kl_norm,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    SEGMENT_PAIRS: tl.constexpr, WITH_INDEX: tl.constexpr, PRECISION: tl.constexpr,
):
    """Key-outer dK, dV (and WITH_INDEX the KL gradient of index_k) of one segment: up to
    SEGMENT_PAIRS (token, index head) pairs that kept one key block, TOK pairs x GQ heads
    (head-major rows) per step; segments run in SEGMENT_ORDER (most pairs first). Writes fp32
    partials (dK unscaled)."""
    segment = tl.load(SEGMENT_ORDER + tl.program_id(0)).to(tl.int64)
    bucket = tl.load(SEGMENTS + 2 * segment).to(tl.int64)
    if bucket < 0:
        return
    first = tl.load(SEGMENTS + 2 * segment + 1).to(tl.int64)
    global_block = bucket // HI
    index_head = bucket % HI
    kv_head = index_head // KV_GROUP
    sequence = tl.load(BLOCK_SEQUENCE + global_block).to(tl.int64)
    block = tl.load(BLOCK_LOCAL + global_block).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    bucket_end = (tl.load(BUCKET_START + bucket) + tl.load(BUCKET_COUNT + bucket)).to(tl.int64)
    last = tl.minimum(first + SEGMENT_PAIRS, bucket_end)
    key_pos, key_valid, k, v, ik = _load_block(
        K, V, IK, seq_start, seq_len, block, kv_head, index_head // INDEX_GROUP, stride_k_t,
        stride_k_h, stride_v_t, stride_v_h, stride_ik_t, stride_ik_h, BLOCK, HEAD_DIM,
        INDEX_DIM, WITH_INDEX)
    dims = tl.arange(0, HEAD_DIM)
    index_dims = tl.arange(0, INDEX_DIM)
    dk = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    d_index_k = tl.zeros((BLOCK, INDEX_DIM), tl.float32)
    if WITH_INDEX:
        dz_scale = tl.load(KL_GRAD) * kl_norm * index_scale
    else:
        dz_scale = 0.0
    rows = tl.arange(0, ROWS)
    row_head = index_head * GQ + rows // TOK
    padded = tl.arange(0, TOKP)
    token_rows_t = tl.trans(_token_rows(TOK, TOKP, ROWS, Q.dtype.element_ty))  # [ROWS, TOKP]
    for first_pair in range(first, last, TOK):
        row_pair = first_pair + rows % TOK
        row_valid = (row_pair < last) & (rows // TOK < GQ)
        row_token = tl.load(PAIR_TOKEN + row_pair, mask=row_valid, other=0).to(tl.int64)
        q = tl.load(Q + row_token[:, None] * stride_q_t + row_head[:, None] * stride_q_h
                    + dims[None, :], mask=row_valid[:, None], other=0.0)  # [ROWS, D]
        dout = tl.load(DOUT + row_token[:, None] * stride_do_t + row_head[:, None] * stride_do_h
                       + dims[None, :], mask=row_valid[:, None], other=0.0)
        lse = tl.load(LSE + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
        delta = tl.load(DELTA + row_token * (HI * GQ) + row_head, mask=row_valid, other=0.0)
        # Transposed products keep the block's keys as the MMA's M dimension.
        scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2
        probs_t = tl.exp2(scores_t - lse[None, :])  # [BLOCK, ROWS]
        # Padding rows (q = dO = 0) add nothing to dK and dV, but the teacher needs them at 0;
        # only queries inside the block (the first pairs: token order) need the causal mask.
        query_pos = row_token - seq_start
        needs_mask = tl.load(PAIR_TOKEN + first_pair) - seq_start < block * BLOCK + BLOCK - 1
        if WITH_INDEX:
            needs_mask = needs_mask | (first_pair + TOK > last) | (GQ < GQ_PAD)
        if needs_mask:
            probs_t = tl.where(row_valid[None, :] & (key_pos[:, None] <= query_pos[None, :]),
                               probs_t, 0.0)
        dv += tl.dot(probs_t.to(dout.dtype), dout, input_precision=PRECISION)
        dprobs_t = tl.dot(v, tl.trans(dout), input_precision=PRECISION)
        dscores_t = probs_t * (dprobs_t - delta[None, :])  # d loss / d (scaled logits)
        dk += tl.dot(dscores_t.to(q.dtype), q, input_precision=PRECISION)
        if WITH_INDEX:
            # The teacher, [BLOCK, TOKP]: each pair's rows summed by an MMA, over GQ.
            teacher_t = _split_dot_left(probs_t, token_rows_t, Q.dtype.element_ty,
                                        PRECISION) / GQ
            pair_valid = (padded < TOK) & (first_pair + padded < last)
            pair_token = tl.load(PAIR_TOKEN + first_pair + padded, mask=pair_valid,
                                 other=0).to(tl.int64)
            index_q = tl.load(IQ + pair_token[:, None] * stride_iq_t + index_head * stride_iq_h
                              + index_dims[None, :], mask=pair_valid[:, None],
                              other=0.0)  # [TOKP, Di], rows TOK.. zero
            z_t = tl.dot(ik, tl.trans(index_q), input_precision=PRECISION) * index_scale
            lse_index = tl.load(LSE_INDEX + pair_token * HI + index_head, mask=pair_valid,
                                other=0.0)
            pair_pos = pair_token - seq_start
            visible_t = pair_valid[None, :] & (key_pos[:, None] <= pair_pos[None, :])
            student_t = tl.where(visible_t, tl.exp(z_t - lse_index[None, :]), 0.0)
            dz_t = student_t - teacher_t  # [BLOCK, TOKP], scaled at the end
            d_index_k += tl.dot(dz_t.to(index_q.dtype), index_q, input_precision=PRECISION)
    offsets = (segment * BLOCK + tl.arange(0, BLOCK))[:, None] * HEAD_DIM + dims[None, :]
    tl.store(DK_PART + offsets, dk)
    tl.store(DV_PART + offsets, dv)
    if WITH_INDEX:
        tl.store(DIK_PART + (segment * BLOCK + tl.arange(0, BLOCK))[:, None] * INDEX_DIM
                 + index_dims[None, :], d_index_k * dz_scale)


@triton.jit
def _reduce_segments_kernel(
    PART, OUT, BUCKET_SEGMENTS_END, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS, stride_t, stride_h,
    scale, HI: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """One (key block, output head) of dK, dV or d index_k: ``scale`` x the sum, in order, of
    the partials of the segments of its GROUP index heads (contiguous buckets)."""
    global_block = tl.program_id(0).to(tl.int64)
    out_head = tl.program_id(1).to(tl.int64)
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
    keys = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    for segment in range(first_segment, end_segment):
        acc += tl.load(PART + (segment * BLOCK + keys)[:, None] * HEAD_DIM + dims[None, :])
    key_pos = block * BLOCK + keys.to(tl.int64)
    tl.store(OUT + (seq_start + key_pos)[:, None] * stride_t + out_head * stride_h
             + dims[None, :], (acc * scale).to(OUT.dtype.element_ty),
             mask=(key_pos < seq_len)[:, None])


def _precision(tensor) -> str:
    """fp32 inputs keep full precision in the MMAs (no TF32); 16-bit inputs are exact anyway."""
    return "ieee" if tensor.dtype == torch.float32 else "tf32"


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def _tile_shape(gq: int, target_rows: int) -> tuple[int, int, int]:
    """(tokens per tile, padded heads, MMA rows) for ``gq`` heads per token: a power-of-two
    token count with about ``target_rows`` rows, and at least 16 rows."""
    heads = triton.next_power_of_2(gq)
    tokens = max(1, target_rows // heads)
    tokens = 1 << (tokens.bit_length() - 1)
    tokens = max(tokens, 16 // min(heads, 16))
    return tokens, heads, heads * tokens


# Launch configurations: the winners of benchmarks/bench_attention.py's sweep on an H200 (main
# attention alone). With the index branch every stage also holds an index-key tile, and two
# stages no longer fit in shared memory (H200: 227 KiB), so those launches use one.
FWD_CONFIG = dict(num_warps=8, num_stages=2)
DQ_CONFIG = dict(num_warps=8, num_stages=2)
DKDV_CONFIG = dict(num_warps=8, num_stages=2)
INDEX_STAGES = 1
# Pairs per dK/dV program: bounds a program's work when many queries keep the same block.
SEGMENT_PAIRS = 2048


class SparseAttentionProblem:
    """Shapes, constants and device-built work lists shared by the forward and the backward.

    ``index_k``, ``index_scale`` (None: main attention only, no KL) describe the index branch.
    """

    def __init__(self, q, k, block_ids, cu_seqlens, block_size, softmax_scale, index_k=None,
                 index_scale=None, query_rows=128, key_rows=64, dense=False):
        self.total, self.num_heads, self.head_dim = q.shape
        self.num_kv_heads = k.shape[1]
        self.num_index_heads, self.top_k = block_ids.shape[1], block_ids.shape[2]
        self.gq = self.num_heads // self.num_index_heads
        self.with_index = index_k is not None
        self.index_dim = index_k.shape[2] if self.with_index else 16
        self.index_group = self.num_index_heads // index_k.shape[1] if self.with_index else 1
        self.index_scale = index_scale if self.with_index else 0.0
        self.block_size = block_size
        self.scale = softmax_scale
        self.dense = dense  # block_ids keep every causal block: skip the per-row membership
        self.block_ids = block_ids
        self.cu_seqlens = cu_seqlens
        self.query_tokens, gq_pad, self.query_rows = _tile_shape(self.gq, query_rows)
        self.key_tokens, _, self.key_rows = _tile_shape(self.gq, key_rows)
        self.query_work: QueryTileWork = build_query_tile_work(block_ids, cu_seqlens,
                                                               self.query_tokens)
        self.shared = dict(HI=self.num_index_heads, GQ=self.gq, GQ_PAD=gq_pad,
                           KV_GROUP=self.num_index_heads // self.num_kv_heads,
                           INDEX_GROUP=self.index_group, BLOCK=block_size,
                           HEAD_DIM=self.head_dim, INDEX_DIM=self.index_dim,
                           PRECISION=_precision(q))

    @functools.cached_property
    def block_work(self) -> BlockWork:
        """The key-block -> queries list, needed by the backward only: built on first use."""
        return build_block_work(self.block_ids, self.cu_seqlens, self.block_size, SEGMENT_PAIRS)

    def query_constants(self):
        return dict(self.shared, DENSE=self.dense, TOK=self.query_tokens,
                    TOKP=max(16, self.query_tokens),
                    ROWS=self.query_rows, TOP_K=self.top_k, TOPK_PAD=_pow2(self.top_k),
                    UNION_SLOTS=self.query_work.union.shape[-1])

    def key_constants(self):
        return dict(self.shared, TOK=self.key_tokens, TOKP=max(16, self.key_tokens),
                    ROWS=self.key_rows, SEGMENT_PAIRS=self.block_work.segment_pairs)

    def stages(self, config):
        return INDEX_STAGES if self.with_index else config["num_stages"]

    def query_grid(self):
        return (self.query_work.schedule.shape[0], self.num_index_heads)

    def query_work_args(self):
        work = self.query_work
        return (self.block_ids, work.schedule, work.union, work.union_count, self.cu_seqlens)


def _strides(*tensors):
    return [stride for t in tensors for stride in (t.stride(0), t.stride(1))]


def sparse_attention_fwd(q, k, v, index_q, index_k, p: SparseAttentionProblem,
                         num_warps=FWD_CONFIG["num_warps"], num_stages=None):
    """q [T, H, D], k, v [T, Hkv, D] (index_q [T, Hi, Di], index_k [T, Hik, Di] or None).
    Returns out [T, H, D] (q's dtype), lse2 [T, H] and the index log-sum-exp [T, Hi] (natural
    log over the kept tokens; None without the index branch), both fp32."""
    out = torch.empty_like(q)
    lse = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
    lse_index = (torch.empty(p.total, p.num_index_heads, dtype=torch.float32, device=q.device)
                 if p.with_index else lse)
    iq, ik = (index_q, index_k) if p.with_index else (q, k)  # unused placeholders otherwise
    _sparse_attn_fwd_kernel[p.query_grid()](
        q, k, v, iq, ik, out, lse, lse_index, *p.query_work_args(),
        *_strides(q, k, v, out, iq, ik), p.scale * LOG2_E, p.index_scale,
        **p.query_constants(), WITH_INDEX=p.with_index, num_warps=num_warps,
        num_stages=num_stages or p.stages(FWD_CONFIG))
    return out, lse, (lse_index if p.with_index else None)


def kl_rows(q, k, v, index_q, index_k, lse, lse_index, p: SparseAttentionProblem):
    """[T, Hi] fp32: sum over the kept keys of t * log(t / s) for every (token, index head)."""
    rows = torch.empty(p.total, p.num_index_heads, dtype=torch.float32, device=q.device)
    _kl_value_kernel[p.query_grid()](
        q, k, v, index_q, index_k, lse, lse_index, rows, *p.query_work_args(),
        *_strides(q, k, v, index_q, index_k), p.scale * LOG2_E, p.index_scale,
        **p.query_constants(), num_warps=FWD_CONFIG["num_warps"], num_stages=INDEX_STAGES)
    return rows


def attention_delta(out, dout, p: SparseAttentionProblem):
    """[T, H] fp32: sum_d dO * O per (token, head)."""
    delta = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=out.device)
    rows = 64 if out.is_cuda else 1024  # the interpreter's cost is per program
    _delta_kernel[(triton.cdiv(p.total * p.num_heads, rows),)](
        out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
        p.total * p.num_heads, NUM_HEADS=p.num_heads, HEAD_DIM=p.head_dim, ROWS=rows)
    return delta


def attention_dq(q, k, v, index_q, index_k, dout, lse, delta, lse_index, kl_grad,
                 p: SparseAttentionProblem, num_warps=DQ_CONFIG["num_warps"], num_stages=None):
    """dq (and d index_q when the problem has an index branch), query-outer."""
    dq = torch.empty_like(q)
    iq, ik = (index_q, index_k) if p.with_index else (q, k)
    d_index_q = torch.empty_like(iq) if p.with_index else dq
    _sparse_attn_dq_kernel[p.query_grid()](
        q, k, v, iq, ik, dout, lse, delta, lse_index if p.with_index else lse,
        kl_grad if p.with_index else lse, dq, d_index_q, *p.query_work_args(),
        *_strides(q, k, v, dout, dq, iq, ik, d_index_q), p.scale, p.scale * LOG2_E,
        p.index_scale, 1.0 / (p.total * p.num_index_heads), **p.query_constants(),
        WITH_INDEX=p.with_index, num_warps=num_warps,
        num_stages=num_stages or p.stages(DQ_CONFIG))
    return dq, (d_index_q if p.with_index else None)


def attention_dkdv(q, k, v, index_q, index_k, dout, lse, delta, lse_index, kl_grad,
                   p: SparseAttentionProblem, num_warps=DKDV_CONFIG["num_warps"],
                   num_stages=None):
    """dk, dv (and d index_k with an index branch), key-outer: fp32 partials per segment of
    pairs, then an in-order sum per key block."""
    blocks = p.block_work
    segments = blocks.segments.shape[0]
    parts = [torch.empty(segments * p.block_size, dim, dtype=torch.float32, device=q.device)
             for dim in (p.head_dim, p.head_dim, p.index_dim if p.with_index else 1)]
    iq, ik = (index_q, index_k) if p.with_index else (q, k)
    _sparse_attn_dkdv_kernel[(segments,)](
        q, k, v, iq, ik, dout, lse, delta, lse_index if p.with_index else lse,
        kl_grad if p.with_index else lse, *parts, blocks.segments, blocks.segment_order,
        blocks.pair_token, blocks.bucket_start, blocks.bucket_count, blocks.block_sequence,
        blocks.block_local, p.cu_seqlens, *_strides(q, k, v, dout, iq, ik),
        p.scale * LOG2_E, p.index_scale, 1.0 / (p.total * p.num_index_heads),
        **p.key_constants(), WITH_INDEX=p.with_index, num_warps=num_warps,
        num_stages=num_stages or p.stages(DKDV_CONFIG))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    outputs = [(parts[0], dk, p.scale, p.shared["KV_GROUP"], p.head_dim),
               (parts[1], dv, 1.0, p.shared["KV_GROUP"], p.head_dim)]
    d_index_k = None
    if p.with_index:
        d_index_k = torch.empty_like(index_k)
        outputs.append((parts[2], d_index_k, 1.0, p.index_group, p.index_dim))
    for part, out, scale, group, dim in outputs:
        _reduce_segments_kernel[(blocks.num_global_blocks, out.shape[1])](
            part, out, blocks.bucket_segments_end, blocks.block_sequence, blocks.block_local,
            p.cu_seqlens, out.stride(0), out.stride(1), scale, HI=p.num_index_heads,
            GROUP=group, BLOCK=p.block_size, HEAD_DIM=dim, num_warps=4)
    return dk, dv, d_index_k


class SparseAttentionFunction(torch.autograd.Function):
    """Autograd over packed inputs (q [T, H, D]; k, v [T, Hkv, D]; index_q [T, Hi, Di] and
    index_k [T, Hik, Di], or None for the main attention alone; block_ids int32 [T, Hi, k]
    token-major). Returns out and the KL (a float32 0-dim tensor: the exact value, or 0 with
    ``kl_value=False``, with the same gradient either way; None without index tensors).
    ``dense``: block_ids keep every causal block (warmup), so no per-row membership is tested."""

    @staticmethod
    def forward(ctx, q, k, v, index_q, index_k, block_ids, cu_seqlens, block_size, softmax_scale,
                index_scale, kl_value, dense=False):
        with_index = index_q is not None
        problem = SparseAttentionProblem(q, k, block_ids, cu_seqlens, block_size, softmax_scale,
                                         index_k, index_scale, dense=dense)
        out, lse, lse_index = sparse_attention_fwd(q, k, v, index_q, index_k, problem)
        if not with_index:
            kl = None
        elif kl_value:
            kl = kl_rows(q, k, v, index_q, index_k, lse, lse_index, problem).sum() / (
                problem.total * problem.num_index_heads)
        else:
            kl = torch.zeros((), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, index_q, index_k, out, lse, lse_index)
        ctx.problem = problem
        return out, kl

    @staticmethod
    def backward(ctx, dout, dkl):
        q, k, v, index_q, index_k, out, lse, lse_index = ctx.saved_tensors
        p = ctx.problem
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        kl_grad = None
        if p.with_index:
            kl_grad = (dkl if dkl is not None else torch.zeros((), device=q.device)).float()
            kl_grad = kl_grad.reshape(1).contiguous()
        delta = attention_delta(out, dout, p)
        dq, d_index_q = attention_dq(q, k, v, index_q, index_k, dout, lse, delta, lse_index,
                                     kl_grad, p)
        dk, dv, d_index_k = attention_dkdv(q, k, v, index_q, index_k, dout, lse, delta,
                                           lse_index, kl_grad, p)
        return dq, dk, dv, d_index_q, d_index_k, None, None, None, None, None, None, None
