"""The KL's Triton kernels (SPEC sections 3.7 and 4): the query-side walk (value and d index_q,
one program per query tile as the forward), the key-outer pass over the dK/dV segments (d index_k,
and with its query side d index_q and the value), and the scaling of the gradients by the
gradient reaching kl.

Both rebuild the teacher (the mean of the GQ main heads' probabilities, from the saved main
log-sum-exps) and the student (from the index log-sum-exp), so the forward saves no
probabilities. The gradients are (s - t) times index keys or queries: they do not depend on dout,
only on the scalar gradient reaching kl, so the forward computes them unscaled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..configs import KL_CONFIG, KL_QUERY_CONFIG
from ..launch import launch, strides
from ..problem import LOG2_E, SparseAttentionProblem
from ..tiles import (_block_keys, _load_rows, _members, _query_tile, _segment, _walk_block,
                     _walk_list)


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
def _kl_kernel(
    Q, K, IQ, IK, LSE, LSE_INDEX, DIK, KL_PARTS, DIQ,
    SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE,
    BLOCK_LOCAL, CU_SEQLENS, query_start,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_iq_t, stride_iq_h,
    stride_ik_t, stride_ik_h, scale_log2, index_scale, TEACHER,
    HI: tl.constexpr, GQ: tl.constexpr, KV_GROUP: tl.constexpr, INDEX_GROUP: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    INDEX_DIM: tl.constexpr, SEGMENT_PAIRS: tl.constexpr, QUERY_SIDE: tl.constexpr,
    WITH_VALUE: tl.constexpr, PRECISION: tl.constexpr, TEACHER_GIVEN: tl.constexpr = False,
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
    whole KL. TEACHER_GIVEN: the teacher is read from TEACHER [pairs, BLOCK] (the dK/dV
    pass's, masked) instead of rebuilt from GQ products: Q, K and LSE go unread."""
    segment, first, last, index_head, block, seq_start, seq_len, query_base = _segment(
        SEGMENTS, SEGMENT_ORDER, BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL,
        CU_SEQLENS, query_start, HI, SEGMENT_PAIRS)
    if segment < 0:
        if QUERY_SIDE and WITH_VALUE:
            tl.store(KL_PARTS + tl.program_id(0), 0.0)
        return
    key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
    if not TEACHER_GIVEN:
        k = _load_rows(K, key_token, key_valid, index_head // KV_GROUP, stride_k_t,
                       stride_k_h, HEAD_DIM)
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
        query_pos = token - query_base.to(tl.int32)
        if TEACHER_GIVEN:
            teacher_t = tl.load(TEACHER + (first_pair + tl.arange(0, PAIRS))[None, :].to(tl.int64)
                                * BLOCK + tl.arange(0, BLOCK)[:, None],
                                mask=pair_valid[None, :], other=0.0).to(tl.float32)
        else:
            teacher_t = tl.zeros((BLOCK, PAIRS), tl.float32)
            for g in range(GQ):
                head = index_head * GQ + g
                q = tl.load(Q + token[:, None].to(tl.int64) * stride_q_t + head * stride_q_h
                            + dims[None, :], mask=pair_valid[:, None], other=0.0)  # [PAIRS, D]
                # +inf for padding pairs: their probabilities come out 0, as the teacher needs.
                lse = tl.load(LSE + token.to(tl.int64) * (HI * GQ) + head, mask=pair_valid,
                              other=float("inf"))
                teacher_t += tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION)
                                     * scale_log2 - lse[None, :])
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


def kl_query_side(q, k, index_q, index_k, lse, lse_index, p: SparseAttentionProblem,
                  with_value: bool, with_grad: bool, num_warps=KL_QUERY_CONFIG["num_warps"],
                  num_stages=KL_QUERY_CONFIG["num_stages"]):
    """The KL's query-side walk. Returns the KL of every (token, index head), fp32 [T, Hi]
    (None unless ``with_value``), and, unless ``with_grad`` is False, the unscaled KL gradient
    of index_q, fp32 [T, Hi, Di]: the gradient is ``kl_grad * p.kl_gradient_scale()`` times it."""
    rows = torch.empty(p.total, p.num_index_heads, dtype=torch.float32, device=q.device)
    d_index_q = (torch.empty(p.total, p.num_index_heads, p.index_dim, dtype=torch.float32,
                             device=q.device) if with_grad else rows)
    launch(_kl_query_kernel, p.query_grid(),
        q, k, index_q, index_k, lse, lse_index, rows, d_index_q, *p.query_work_args(),
        *strides(q, k, index_q, index_k), p.scale * LOG2_E, p.index_scale,
        **p.query_constants(), WITH_VALUE=with_value, WITH_GRAD=with_grad,
        num_warps=num_warps, num_stages=num_stages)
    return (rows if with_value else None), (d_index_q if with_grad else None)


def triton_key_walk(q, k, index_q, index_k, lse, lse_index, p: SparseAttentionProblem,
                    d_index_k, value_parts, d_index_q, query_side: bool, with_value: bool,
                    pairs: int, num_warps=KL_CONFIG["num_warps"],
                    num_stages=KL_CONFIG["num_stages"], teacher=None):
    """The key-outer KL kernel over ``p``'s key-block list, ``pairs`` pairs a step, into the
    buffers ``kl.kl_key_walk`` gives (see there); ``teacher``: each pair's teacher [pairs,
    block], read instead of rebuilt."""
    launch(_kl_kernel, (p.block_work.segments.shape[0],),
        q, k, index_q, index_k, lse, lse_index, d_index_k, value_parts, d_index_q,
        *p.key_work_args(),
        *strides(q, k, index_q, index_k), p.scale * LOG2_E, p.index_scale, teacher,
        **p.kl_constants(pairs), QUERY_SIDE=query_side, WITH_VALUE=with_value,
        TEACHER_GIVEN=teacher is not None, num_warps=num_warps, num_stages=num_stages)
