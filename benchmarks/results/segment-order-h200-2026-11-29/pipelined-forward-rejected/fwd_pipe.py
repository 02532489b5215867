"""Experiment: software-pipelined forward (QK^T of the next block issued before PV of this one)."""
import triton
import triton.language as tl
from openmsa.ops.attention import (_query_tile, _walk_list, _walk_block, _block_keys, _load_rows,
                                   _members)


@triton.jit
def _softmax_step(scores, needs_mask, members, block, seq_len, row_valid, tok_valid,
                  row_position, running_max, running_sum, TOK: tl.constexpr, TOKP: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK: tl.constexpr):
    if needs_mask:
        row_member, tok_member = _members(members, row_valid, tok_valid, TOK, TOKP, ROWS)
        key_pos = block.to(tl.int32) * BLOCK + tl.arange(0, BLOCK)
        visible = (row_member[:, None] & (key_pos < seq_len.to(tl.int32))[None, :]
                   & (key_pos[None, :] <= row_position.to(tl.int32)[:, None]))
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(running_max - safe_max)
    probs = tl.exp2(scores - safe_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    return probs, rescale, new_max, running_sum


@triton.jit
def _index_step(IK, index_q, index_max, index_terms, key_token, key_valid, key_pos, needs_mask,
                members, row_valid, tok_valid, tok_position, index_key_head, stride_ik_t,
                stride_ik_h, index_scale, TOK: tl.constexpr, TOKP: tl.constexpr,
                ROWS: tl.constexpr, INDEX_DIM: tl.constexpr, PRECISION: tl.constexpr):
    ik = _load_rows(IK, key_token, key_valid, index_key_head, stride_ik_t, stride_ik_h, INDEX_DIM)
    z = tl.dot(index_q, tl.trans(ik), input_precision=PRECISION) * index_scale
    terms = tl.exp(z - index_max[:, None])
    if needs_mask:
        row_member, tok_member = _members(members, row_valid, tok_valid, TOK, TOKP, ROWS)
        tok_visible = (tok_member[:, None] & key_valid[None, :]
                       & (key_pos[None, :] <= tok_position[:, None]))
        terms = tl.where(tok_visible, terms, 0.0)
    return index_terms + terms


@triton.jit
def fwd_pipe_kernel(
    Q, K, V, IQ, IK, OUT, LSE, LSE_INDEX, INDEX_MAX, SCHEDULE, UNION, UNION_MEMBERS,
    UNION_COUNT, CU_SEQLENS, query_start, query_end,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, stride_iq_t, stride_iq_h, stride_ik_t, stride_ik_h,
    scale_log2, index_scale,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    UNION_SLOTS: tl.constexpr, WITH_INDEX: tl.constexpr, INDEX_MAX_GIVEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
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
    if WITH_INDEX:
        index_q = _load_rows(IQ, tok_token, tok_valid, index_head, stride_iq_t, stride_iq_h,
                             INDEX_DIM)  # [TOKP, Di]
        index_max = tl.load(INDEX_MAX + tok_token * HI + index_head, mask=tok_valid, other=0.0)
        index_terms = tl.zeros((TOKP, BLOCK), tl.float32)
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    blocks, members_of, walk_length = _walk_list(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                                 index_head, HI, UNION_SLOTS)
    if walk_length > 0:
        block, members, needs_mask = _walk_block(blocks, members_of, 0, first_position,
                                                 all_members, BLOCK)
        key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
        k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        for u in range(1, walk_length):
            probs, rescale, running_max, running_sum = _softmax_step(
                scores, needs_mask, members, block, seq_len, row_valid, tok_valid,
                row_position, running_max, running_sum, TOK, TOKP, ROWS, BLOCK)
            key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
            v = _load_rows(V, key_token, key_valid, kv_head, stride_v_t, stride_v_h, HEAD_DIM)
            if WITH_INDEX:
                index_terms = _index_step(IK, index_q, index_max, index_terms, key_token, key_valid, key_pos, needs_mask, members, row_valid, tok_valid, tok_position, index_head // INDEX_GROUP, stride_ik_t, stride_ik_h, index_scale, TOK, TOKP, ROWS, INDEX_DIM, PRECISION)
            block, members, needs_mask = _walk_block(blocks, members_of, u, first_position,
                                                     all_members, BLOCK)
            key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
            k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None], input_precision=PRECISION)
        probs, rescale, running_max, running_sum = _softmax_step(
            scores, needs_mask, members, block, seq_len, row_valid, tok_valid,
            row_position, running_max, running_sum, TOK, TOKP, ROWS, BLOCK)
        key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
        v = _load_rows(V, key_token, key_valid, kv_head, stride_v_t, stride_v_h, HEAD_DIM)
        if WITH_INDEX:
            index_terms = _index_step(IK, index_q, index_max, index_terms, key_token, key_valid, key_pos, needs_mask, members, row_valid, tok_valid, tok_position, index_head // INDEX_GROUP, stride_ik_t, stride_ik_h, index_scale, TOK, TOKP, ROWS, INDEX_DIM, PRECISION)
        acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None], input_precision=PRECISION)
    running_sum = tl.where(row_valid, running_sum, 1.0)
    tl.store(OUT + row_token[:, None] * stride_o_t + row_head[:, None] * stride_o_h
             + dims[None, :], (acc / running_sum[:, None]).to(OUT.dtype.element_ty),
             mask=row_valid[:, None])
    tl.store(LSE + row_token * (HI * GQ) + row_head, running_max + tl.log2(running_sum),
             mask=row_valid)
    if WITH_INDEX:
        index_sum = tl.where(tok_valid, tl.sum(index_terms, axis=1), 1.0)
        tl.store(LSE_INDEX + tok_token * HI + index_head, index_max + tl.log(index_sum),
                 mask=tok_valid)
