"""Experiment: the forward with its 128-row tile split into two 64-row halves whose phases are
interleaved in the source (both QK^T first; then softmax A, PV A, softmax B, PV B), so that one
half's MMA can run while the other half's exponentials do."""
import triton
import triton.language as tl
from openmsa.ops.attention import _walk_list, _walk_block, _block_keys, _load_rows


@triton.jit
def _softmax_pv(scores, v, running_max, running_sum, acc, visible, needs_mask,
                PRECISION: tl.constexpr):
    if needs_mask:
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp2(running_max - safe_max)
    probs = tl.exp2(scores - safe_max[:, None])
    running_sum = running_sum * rescale + tl.sum(probs, axis=1)
    acc = tl.dot(probs.to(v.dtype), v, acc * rescale[:, None], input_precision=PRECISION)
    return new_max, running_sum, acc


@triton.jit
def _half_rows(SCHEDULE, CU_SEQLENS, entry, index_head, first_row, GQ: tl.constexpr,
               TOK: tl.constexpr, HALF: tl.constexpr):
    sequence = tl.load(SCHEDULE + 2 * entry).to(tl.int64)
    tile = tl.load(SCHEDULE + 2 * entry + 1).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    rows = first_row + tl.arange(0, HALF)
    position = tile * TOK + rows % TOK
    valid = (rows // TOK < GQ) & (position < seq_len)
    return seq_start, seq_len, valid, seq_start + position, position, index_head * GQ + rows // TOK, rows % TOK


@triton.jit
def _fwd_split_kernel(
    Q, K, V, OUT, LSE, SCHEDULE, UNION, UNION_MEMBERS, UNION_COUNT, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, KV_GROUP: tl.constexpr,
    INDEX_GROUP: tl.constexpr, TOK: tl.constexpr, TOKP: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, INDEX_DIM: tl.constexpr,
    UNION_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
):
    HALF: tl.constexpr = ROWS // 2
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:
        return
    seq_start, seq_len, valid_a, token_a, pos_a, head_a, bit_a = _half_rows(
        SCHEDULE, CU_SEQLENS, entry, index_head, 0, GQ, TOK, HALF)
    _, _, valid_b, token_b, pos_b, head_b, bit_b = _half_rows(
        SCHEDULE, CU_SEQLENS, entry, index_head, HALF, GQ, TOK, HALF)
    first_position = tl.load(SCHEDULE + 2 * entry + 1).to(tl.int64) * TOK
    tile_tokens = tl.minimum(seq_len - first_position, TOK)
    all_members = tl.where(tile_tokens >= 64, -1, (tl.full((), 1, tl.int64) << tile_tokens) - 1)
    kv_head = index_head // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_a = tl.load(Q + token_a[:, None] * stride_q_t + head_a[:, None] * stride_q_h + dims[None, :],
                  mask=valid_a[:, None], other=0.0)
    q_b = tl.load(Q + token_b[:, None] * stride_q_t + head_b[:, None] * stride_q_h + dims[None, :],
                  mask=valid_b[:, None], other=0.0)
    max_a = tl.full((HALF,), float("-inf"), tl.float32)
    max_b = tl.full((HALF,), float("-inf"), tl.float32)
    sum_a = tl.zeros((HALF,), tl.float32)
    sum_b = tl.zeros((HALF,), tl.float32)
    acc_a = tl.zeros((HALF, HEAD_DIM), tl.float32)
    acc_b = tl.zeros((HALF, HEAD_DIM), tl.float32)
    blocks, members_of, walk_length = _walk_list(UNION, UNION_MEMBERS, UNION_COUNT, entry,
                                                 index_head, HI, UNION_SLOTS)
    for u in range(0, walk_length):
        block, members, needs_mask = _walk_block(blocks, members_of, u, first_position,
                                                 all_members, BLOCK)
        key_pos, key_valid, key_token = _block_keys(seq_start, seq_len, block, BLOCK)
        k = _load_rows(K, key_token, key_valid, kv_head, stride_k_t, stride_k_h, HEAD_DIM)
        v = _load_rows(V, key_token, key_valid, kv_head, stride_v_t, stride_v_h, HEAD_DIM)
        scores_a = tl.dot(q_a, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores_b = tl.dot(q_b, tl.trans(k), input_precision=PRECISION) * scale_log2
        member_a = (((members >> bit_a) & 1) != 0) & valid_a
        member_b = (((members >> bit_b) & 1) != 0) & valid_b
        visible_a = member_a[:, None] & key_valid[None, :] & (key_pos[None, :] <= pos_a[:, None])
        visible_b = member_b[:, None] & key_valid[None, :] & (key_pos[None, :] <= pos_b[:, None])
        max_a, sum_a, acc_a = _softmax_pv(scores_a, v, max_a, sum_a, acc_a, visible_a,
                                          needs_mask, PRECISION)
        max_b, sum_b, acc_b = _softmax_pv(scores_b, v, max_b, sum_b, acc_b, visible_b,
                                          needs_mask, PRECISION)
    sum_a = tl.where(valid_a, sum_a, 1.0)
    sum_b = tl.where(valid_b, sum_b, 1.0)
    tl.store(OUT + token_a[:, None] * stride_o_t + head_a[:, None] * stride_o_h + dims[None, :],
             (acc_a / sum_a[:, None]).to(OUT.dtype.element_ty), mask=valid_a[:, None])
    tl.store(OUT + token_b[:, None] * stride_o_t + head_b[:, None] * stride_o_h + dims[None, :],
             (acc_b / sum_b[:, None]).to(OUT.dtype.element_ty), mask=valid_b[:, None])
    tl.store(LSE + token_a * (HI * GQ) + head_a, max_a + tl.log2(sum_a), mask=valid_a)
    tl.store(LSE + token_b * (HI * GQ) + head_b, max_b + tl.log2(sum_b), mask=valid_b)
