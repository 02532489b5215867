"""Sparse main attention over the kept blocks (SPEC section 3, steps 5-6), forward and backward.

Key-block-outer: a program takes one key block and a tile of the (token, slot) pairs that kept it
(``openmsa.ops.csr``), and stacks the tile's tokens x the index head's ``GQ = H / Hi`` main heads
into the rows of one MMA, so the tensor cores see 64-128 rows although each token brings only
``GQ``. See docs/KERNELS.md for the design and its measurements.

Forward: each (token, slot) gets a partial output normalized over its block and the block's
log-sum-exp; a combine kernel merges the ``top_k`` partials of a query per head. Backward: one
program per (key block, KV head) accumulates dK and dV over every pair that kept the block (no
atomics), and writes each pair's dQ contribution to its slot; a combine kernel sums the slots.
Both passes are deterministic: every sum runs in a fixed order.

Log-sum-exps are kept in base 2 of the scaled scores (``lse2 = log2 sum 2^(c * log2(e) * q.k)``),
so ``P = 2^(c * log2(e) * q.k - lse2)``; the natural-log LSE is ``lse2 * ln 2``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .csr import BlockWork, QueryTileWork, build_block_work, build_query_tile_work

LOG2_E = math.log2(math.e)


@triton.jit
def _load_pair_rows(PAIR_TOKEN, PAIR_SLOT, first_pair, pair_end, index_head,
                    GQ: tl.constexpr, TOK: tl.constexpr, ROWS: tl.constexpr):
    """Rows of one tile: TOK pairs x GQ heads. Returns (valid, packed token, flat slot, head)."""
    rows = tl.arange(0, ROWS)
    pair = first_pair + rows // GQ
    valid = (rows < TOK * GQ) & (pair < pair_end)
    token = tl.load(PAIR_TOKEN + pair, mask=valid, other=0).to(tl.int64)
    slot = tl.load(PAIR_SLOT + pair, mask=valid, other=0)
    head = index_head * GQ + rows % GQ
    return valid, token, slot, head


@triton.jit
def _sparse_attn_fwd_kernel(
    Q, K, V, O_PART, LSE_PART, TILES, PAIR_TOKEN, PAIR_SLOT, BUCKET_START, BUCKET_COUNT,
    BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, KV_GROUP: tl.constexpr, TOK: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    bucket = tl.load(TILES + 2 * tile).to(tl.int64)
    if bucket < 0:
        return
    first_pair = tl.load(TILES + 2 * tile + 1).to(tl.int64)
    global_block = bucket // HI
    index_head = bucket % HI
    pair_end = (tl.load(BUCKET_START + bucket) + tl.load(BUCKET_COUNT + bucket)).to(tl.int64)
    sequence = tl.load(BLOCK_SEQUENCE + global_block).to(tl.int64)
    block = tl.load(BLOCK_LOCAL + global_block).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    kv_head = index_head // KV_GROUP

    valid, token, slot, head = _load_pair_rows(PAIR_TOKEN, PAIR_SLOT, first_pair, pair_end,
                                               index_head, GQ, TOK, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=valid[:, None], other=0.0)  # [ROWS, D]
    key_pos = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)  # [BLOCK] position in sequence
    key_valid = key_pos < seq_len
    k = tl.load(K + (seq_start + key_pos)[:, None] * stride_k_t + kv_head * stride_k_h
                + dims[None, :], mask=key_valid[:, None], other=0.0)  # [BLOCK, D]
    v = tl.load(V + (seq_start + key_pos)[:, None] * stride_v_t + kv_head * stride_v_h
                + dims[None, :], mask=key_valid[:, None], other=0.0)

    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [ROWS, BLOCK]
    query_pos = token - seq_start
    visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    row_max = tl.max(scores, axis=1)
    row_max = tl.where(valid, row_max, 0.0)  # padding rows see no key
    probs = tl.exp2(scores - row_max[:, None])
    row_sum = tl.sum(probs, axis=1)
    row_sum = tl.where(valid, row_sum, 1.0)
    out = tl.dot(probs.to(v.dtype), v, input_precision=PRECISION) / row_sum[:, None]  # [ROWS, D]
    partial = slot * GQ + head % GQ  # [ROWS] row of the (token, head, slot) partial
    tl.store(O_PART + partial[:, None] * HEAD_DIM + dims[None, :], out.to(O_PART.dtype.element_ty),
             mask=valid[:, None])
    tl.store(LSE_PART + partial, row_max + tl.log2(row_sum), mask=valid)


@triton.jit
def _query_tile_rows(SCHEDULE, CU_SEQLENS, entry, index_head, GQ: tl.constexpr,
                     TOK: tl.constexpr, ROWS: tl.constexpr):
    """Rows of a (real) query tile: TOK consecutive tokens of one sequence x the GQ heads of
    ``index_head``. Returns (seq_start, seq_len, valid, token, position, head)."""
    sequence = tl.load(SCHEDULE + 2 * entry).to(tl.int64)
    tile = tl.load(SCHEDULE + 2 * entry + 1).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    rows = tl.arange(0, ROWS)
    position = tile * TOK + rows // GQ  # [ROWS] position in the sequence
    valid = (rows < TOK * GQ) & (position < seq_len)
    head = index_head * GQ + rows % GQ
    return seq_start, seq_len, valid, seq_start + position, position, head


@triton.jit
def _sparse_attn_fwd_query_kernel(
    Q, K, V, OUT, LSE, IDS, SCHEDULE, UNION, UNION_COUNT, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, KV_GROUP: tl.constexpr, TOK: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TOP_K: tl.constexpr,
    TOPK_PAD: tl.constexpr, UNION_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Query-outer forward: one program per (query tile, index head) walks the distinct blocks
    its tokens kept (flash-attention style online softmax); each row attends to the blocks of
    its own token only. No partials: out and lse2 are written directly."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:  # padding entry
        return
    seq_start, seq_len, valid, token, position, head = _query_tile_rows(
        SCHEDULE, CU_SEQLENS, entry, index_head, GQ, TOK, ROWS)
    kv_head = index_head // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=valid[:, None], other=0.0)  # [ROWS, D]
    slots = tl.arange(0, TOPK_PAD)
    row_ids = tl.load(IDS + (token * HI + index_head)[:, None] * TOP_K + slots[None, :],
                      mask=valid[:, None] & (slots[None, :] < TOP_K), other=-1)  # [ROWS, K]
    key_offsets = tl.arange(0, BLOCK).to(tl.int64)
    first_position = tl.min(tl.where(valid, position, 1 << 62))
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    union_base = UNION + (entry * HI + index_head) * UNION_SLOTS
    for u in range(0, tl.load(UNION_COUNT + entry * HI + index_head)):
        block = tl.load(union_base + u).to(tl.int64)
        key_pos = block * BLOCK + key_offsets
        key_valid = key_pos < seq_len
        k = tl.load(K + (seq_start + key_pos)[:, None] * stride_k_t + kv_head * stride_k_h
                    + dims[None, :], mask=key_valid[:, None], other=0.0)
        v = tl.load(V + (seq_start + key_pos)[:, None] * stride_v_t + kv_head * stride_v_h
                    + dims[None, :], mask=key_valid[:, None], other=0.0)
        member = tl.max((row_ids == block).to(tl.int32), axis=1) > 0  # row's token kept it
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        # A block before the tile's first token that every row kept needs no mask.
        if (block * BLOCK + BLOCK > first_position) | (tl.min(member.to(tl.int32)) == 0):
            visible = (member[:, None] & key_valid[None, :]
                       & (key_pos[None, :] <= position[:, None]))
            scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(running_max - safe_max)
        probs = tl.exp2(scores - safe_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    running_sum = tl.where(valid, running_sum, 1.0)
    tl.store(OUT + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
             (acc / running_sum[:, None]).to(OUT.dtype.element_ty), mask=valid[:, None])
    tl.store(LSE + token * (HI * GQ) + head, running_max + tl.log2(running_sum), mask=valid)


@triton.jit
def _sparse_attn_dq_kernel(
    Q, K, V, DOUT, LSE, DELTA, DQ, IDS, SCHEDULE, UNION, UNION_COUNT, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, stride_dq_t, stride_dq_h, scale, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, KV_GROUP: tl.constexpr, TOK: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, TOP_K: tl.constexpr,
    TOPK_PAD: tl.constexpr, UNION_SLOTS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Query-outer dQ: the same walk as the forward, accumulating dQ in registers."""
    entry = tl.program_id(0).to(tl.int64)
    index_head = tl.program_id(1).to(tl.int64)
    if tl.load(SCHEDULE + 2 * entry) < 0:  # padding entry
        return
    seq_start, seq_len, valid, token, position, head = _query_tile_rows(
        SCHEDULE, CU_SEQLENS, entry, index_head, GQ, TOK, ROWS)
    kv_head = index_head // KV_GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
                mask=valid[:, None], other=0.0)
    dout = tl.load(DOUT + token[:, None] * stride_do_t + head[:, None] * stride_do_h
                   + dims[None, :], mask=valid[:, None], other=0.0)
    lse = tl.load(LSE + token * (HI * GQ) + head, mask=valid, other=0.0)
    delta = tl.load(DELTA + token * (HI * GQ) + head, mask=valid, other=0.0)
    slots = tl.arange(0, TOPK_PAD)
    row_ids = tl.load(IDS + (token * HI + index_head)[:, None] * TOP_K + slots[None, :],
                      mask=valid[:, None] & (slots[None, :] < TOP_K), other=-1)
    key_offsets = tl.arange(0, BLOCK).to(tl.int64)
    first_position = tl.min(tl.where(valid, position, 1 << 62))
    dq = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    union_base = UNION + (entry * HI + index_head) * UNION_SLOTS
    for u in range(0, tl.load(UNION_COUNT + entry * HI + index_head)):
        block = tl.load(union_base + u).to(tl.int64)
        key_pos = block * BLOCK + key_offsets
        key_valid = key_pos < seq_len
        k = tl.load(K + (seq_start + key_pos)[:, None] * stride_k_t + kv_head * stride_k_h
                    + dims[None, :], mask=key_valid[:, None], other=0.0)
        v = tl.load(V + (seq_start + key_pos)[:, None] * stride_v_t + kv_head * stride_v_h
                    + dims[None, :], mask=key_valid[:, None], other=0.0)
        member = tl.max((row_ids == block).to(tl.int32), axis=1) > 0
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        probs = tl.exp2(scores - lse[:, None])
        if (block * BLOCK + BLOCK > first_position) | (tl.min(member.to(tl.int32)) == 0):
            visible = (member[:, None] & key_valid[None, :]
                       & (key_pos[None, :] <= position[:, None]))
            probs = tl.where(visible, probs, 0.0)
        dprobs = tl.dot(dout, tl.trans(v), input_precision=PRECISION)
        dscores = probs * (dprobs - delta[:, None])
        dq += tl.dot(dscores.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + token[:, None] * stride_dq_t + head[:, None] * stride_dq_h + dims[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _combine_rows(pair_row_base, NUM_PAIR_ROWS, HI: tl.constexpr, GQ: tl.constexpr,
                  ROWS: tl.constexpr):
    """Rows of a combine program: consecutive (token, index head) pair rows x GQ heads.
    Returns (valid, pair_row, token, head)."""
    rows = tl.arange(0, ROWS)
    pair_row = pair_row_base + rows // GQ
    valid = (rows < (ROWS // GQ) * GQ) & (pair_row < NUM_PAIR_ROWS)
    token = pair_row // HI
    head = (pair_row % HI) * GQ + rows % GQ
    return valid, pair_row, token, head


@triton.jit
def _combine_fwd_kernel(
    O_PART, LSE_PART, IDS, OUT, LSE, stride_o_t, stride_o_h, NUM_PAIR_ROWS,
    HI: tl.constexpr, GQ: tl.constexpr, TOP_K: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Merges the top_k partials of each (token, head): out and its lse2."""
    valid, pair_row, token, head = _combine_rows(tl.program_id(0).to(tl.int64) * (ROWS // GQ),
                                                 NUM_PAIR_ROWS, HI, GQ, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    running_max = tl.full((ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    for s in range(TOP_K):
        flat_slot = pair_row * TOP_K + s
        kept = valid & (tl.load(IDS + flat_slot, mask=valid, other=-1) >= 0)
        partial = flat_slot * GQ + head % GQ
        lse = tl.load(LSE_PART + partial, mask=kept, other=float("-inf"))
        part = tl.load(O_PART + partial[:, None] * HEAD_DIM + dims[None, :], mask=kept[:, None],
                       other=0.0).to(tl.float32)
        new_max = tl.maximum(running_max, lse)
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # no kept slot yet
        rescale = tl.exp2(running_max - safe_max)
        weight = tl.exp2(lse - safe_max)
        acc = acc * rescale[:, None] + part * weight[:, None]
        running_sum = running_sum * rescale + weight
        running_max = new_max
    running_sum = tl.where(valid, running_sum, 1.0)
    tl.store(OUT + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
             (acc / running_sum[:, None]).to(OUT.dtype.element_ty), mask=valid[:, None])
    tl.store(LSE + token * (HI * GQ) + head, running_max + tl.log2(running_sum), mask=valid)


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
    Q, K, V, DOUT, LSE, DELTA, DK, DV, ORDER, PAIR_TOKEN, BUCKET_START, BUCKET_COUNT,
    BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, stride_dk_t, stride_dk_h, stride_dv_t, stride_dv_h,
    scale, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, KV_GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    TOK: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Key-outer dK, dV: one program per (global key block, KV head), taken in ORDER (most pairs
    first), accumulates over every (token, head) that kept the block, in token order."""
    item = tl.load(ORDER + tl.program_id(0)).to(tl.int64)
    global_block = item // NUM_KV_HEADS
    kv_head = item % NUM_KV_HEADS
    sequence = tl.load(BLOCK_SEQUENCE + global_block).to(tl.int64)
    if sequence < 0:
        return
    block = tl.load(BLOCK_LOCAL + global_block).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    dims = tl.arange(0, HEAD_DIM)
    key_pos = block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    key_valid = key_pos < seq_len
    k = tl.load(K + (seq_start + key_pos)[:, None] * stride_k_t + kv_head * stride_k_h
                + dims[None, :], mask=key_valid[:, None], other=0.0)  # [BLOCK, D]
    v = tl.load(V + (seq_start + key_pos)[:, None] * stride_v_t + kv_head * stride_v_h
                + dims[None, :], mask=key_valid[:, None], other=0.0)
    dk = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    rows = tl.arange(0, ROWS)
    for member in range(KV_GROUP):  # the index heads that read this KV head
        index_head = kv_head * KV_GROUP + member
        bucket = global_block * HI + index_head
        pair_start = tl.load(BUCKET_START + bucket).to(tl.int64)
        pair_end = pair_start + tl.load(BUCKET_COUNT + bucket).to(tl.int64)
        for first_pair in range(pair_start, pair_end, TOK):
            pair = first_pair + rows // GQ
            valid = (rows < TOK * GQ) & (pair < pair_end)
            token = tl.load(PAIR_TOKEN + pair, mask=valid, other=0).to(tl.int64)
            head = index_head * GQ + rows % GQ
            q = tl.load(Q + token[:, None] * stride_q_t + head[:, None] * stride_q_h
                        + dims[None, :], mask=valid[:, None], other=0.0)  # [ROWS, D]
            dout = tl.load(DOUT + token[:, None] * stride_do_t + head[:, None] * stride_do_h
                           + dims[None, :], mask=valid[:, None], other=0.0)
            lse = tl.load(LSE + token * (HI * GQ) + head, mask=valid, other=0.0)
            delta = tl.load(DELTA + token * (HI * GQ) + head, mask=valid, other=0.0)
            # Transposed products keep the block's keys as the MMA's M dimension.
            scores_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale_log2
            probs_t = tl.exp2(scores_t - lse[None, :])  # [BLOCK, ROWS]
            # Padding rows have q = dO = 0 and add nothing; only queries inside the block (the
            # first pairs: they are in token order) need the causal mask.
            if tl.load(PAIR_TOKEN + first_pair) - seq_start < block * BLOCK + BLOCK - 1:
                query_pos = token - seq_start
                probs_t = tl.where(key_pos[:, None] <= query_pos[None, :], probs_t, 0.0)
            dv += tl.dot(probs_t.to(dout.dtype), dout, input_precision=PRECISION)
            dprobs_t = tl.dot(v, tl.trans(dout), input_precision=PRECISION)
            dscores_t = probs_t * (dprobs_t - delta[None, :])  # d loss / d (scaled logits)
            dk += tl.dot(dscores_t.to(q.dtype), q, input_precision=PRECISION)
    tl.store(DK + (seq_start + key_pos)[:, None] * stride_dk_t + kv_head * stride_dk_h
             + dims[None, :], (dk * scale).to(DK.dtype.element_ty), mask=key_valid[:, None])
    tl.store(DV + (seq_start + key_pos)[:, None] * stride_dv_t + kv_head * stride_dv_h
             + dims[None, :], dv.to(DV.dtype.element_ty), mask=key_valid[:, None])


def _rows_for(gq: int, target_rows: int) -> tuple[int, int]:
    """(tokens per tile, padded MMA rows) for ``gq`` heads per token and about ``target_rows``."""
    tokens = max(1, target_rows // gq)
    tokens = 1 << (tokens.bit_length() - 1)  # a power of two
    return tokens, max(16, triton.next_power_of_2(tokens * gq))


def _precision(tensor) -> str:
    """fp32 inputs keep full precision in the MMAs (no TF32); 16-bit inputs are exact anyway."""
    return "ieee" if tensor.dtype == torch.float32 else "tf32"


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


def _combine_rows_for(gq: int, tensor) -> int:
    """Rows of the memory-bound combine kernels: whole groups of ``gq`` heads, ~64 rows on a GPU;
    many more under the CPU interpreter, whose cost is per program."""
    target = 64 if tensor.is_cuda else 1024
    return triton.next_power_of_2(max(gq, target))


class SparseAttentionProblem:
    """Shapes and the work lists shared by the forward and the backward of one call."""

    def __init__(self, q, k, block_ids, cu_seqlens, block_size, softmax_scale,
                 query_rows=128, key_rows=64):
        self.total, self.num_heads, self.head_dim = q.shape
        self.num_kv_heads = k.shape[1]
        self.num_index_heads, self.top_k = block_ids.shape[1], block_ids.shape[2]
        self.gq = self.num_heads // self.num_index_heads
        self.kv_group = self.num_index_heads // self.num_kv_heads
        self.block_size = block_size
        self.scale = softmax_scale
        self.query_tokens, self.query_rows = _rows_for(self.gq, query_rows)
        self.key_tokens, self.key_rows = _rows_for(self.gq, key_rows)
        self.block_ids = block_ids
        self.cu_seqlens = cu_seqlens
        self.query_work: QueryTileWork = build_query_tile_work(block_ids, cu_seqlens,
                                                               self.query_tokens)
        self.block_work: BlockWork = build_block_work(block_ids, cu_seqlens, block_size,
                                                      self.key_tokens)
        # dK/dV programs, most pairs first (longest-processing-time order evens out the tail).
        pairs = self.block_work.bucket_count.view(-1, self.num_kv_heads, self.kv_group).sum(-1)
        self.dkdv_order = torch.argsort(pairs.flatten(), descending=True,
                                        stable=True).to(torch.int32)

    def query_constants(self, q):
        return dict(HI=self.num_index_heads, GQ=self.gq, KV_GROUP=self.kv_group,
                    TOK=self.query_tokens, ROWS=self.query_rows, BLOCK=self.block_size,
                    HEAD_DIM=self.head_dim, TOP_K=self.top_k, TOPK_PAD=_pow2(self.top_k),
                    UNION_SLOTS=self.query_work.union.shape[-1], PRECISION=_precision(q))


# Launch configurations: the winners of benchmarks/bench_attention.py's sweep on an H200.
FWD_CONFIG = dict(num_warps=8, num_stages=2)
DQ_CONFIG = dict(num_warps=8, num_stages=2)
DKDV_CONFIG = dict(num_warps=8, num_stages=2)


def sparse_attention_fwd(q, k, v, problem: SparseAttentionProblem, schedule="query",
                         num_warps=FWD_CONFIG["num_warps"], num_stages=FWD_CONFIG["num_stages"]):
    """q: [T, H, D]; k, v: [T, Hkv, D]. Returns out [T, H, D] (q's dtype) and lse2 [T, H] fp32.

    ``schedule="query"`` walks each query tile's kept blocks (the default: no partial outputs);
    ``"key"`` is the key-block-outer alternative with per-slot partials and a combine, kept for
    comparison (docs/KERNELS.md has both measured).
    """
    p = problem
    out = torch.empty_like(q)
    lse = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
    if schedule == "query":
        work = p.query_work
        _sparse_attn_fwd_query_kernel[(work.schedule.shape[0], p.num_index_heads)](
            q, k, v, out, lse, p.block_ids, work.schedule, work.union, work.union_count,
            p.cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), out.stride(0), out.stride(1), p.scale * LOG2_E,
            **p.query_constants(q), num_warps=num_warps, num_stages=num_stages)
        return out, lse
    work = p.block_work
    slots = p.total * p.num_index_heads * p.top_k
    out_part = torch.empty(slots * p.gq, p.head_dim, dtype=q.dtype, device=q.device)
    lse_part = torch.empty(slots * p.gq, dtype=torch.float32, device=q.device)
    _sparse_attn_fwd_kernel[(work.tiles.shape[0],)](
        q, k, v, out_part, lse_part, work.tiles, work.pair_token, work.pair_slot,
        work.bucket_start, work.bucket_count, work.block_sequence, work.block_local,
        p.cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), p.scale * LOG2_E,
        HI=p.num_index_heads, GQ=p.gq, KV_GROUP=p.kv_group, TOK=p.key_tokens, ROWS=p.key_rows,
        BLOCK=p.block_size, HEAD_DIM=p.head_dim, PRECISION=_precision(q),
        num_warps=num_warps, num_stages=num_stages)
    rows = _combine_rows_for(p.gq, q)
    pair_rows = p.total * p.num_index_heads
    _combine_fwd_kernel[(triton.cdiv(pair_rows, rows // p.gq),)](
        out_part, lse_part, p.block_ids, out, lse, out.stride(0), out.stride(1), pair_rows,
        HI=p.num_index_heads, GQ=p.gq, TOP_K=p.top_k, HEAD_DIM=p.head_dim, ROWS=rows,
        num_warps=4)
    return out, lse


def attention_delta(out, dout, p: SparseAttentionProblem):
    """[T, H] fp32: sum_d dO * O per (token, head)."""
    delta = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=out.device)
    rows = _combine_rows_for(1, out)
    _delta_kernel[(triton.cdiv(p.total * p.num_heads, rows),)](
        out, dout, delta, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
        p.total * p.num_heads, NUM_HEADS=p.num_heads, HEAD_DIM=p.head_dim, ROWS=rows)
    return delta


def attention_dq(q, k, v, dout, lse, delta, p: SparseAttentionProblem, num_warps=8,
                 num_stages=2):
    """dq, query-outer: each query tile walks its kept-block union (the forward's walk)."""
    dq = torch.empty_like(q)
    work = p.query_work
    _sparse_attn_dq_kernel[(work.schedule.shape[0], p.num_index_heads)](
        q, k, v, dout, lse, delta, dq, p.block_ids, work.schedule, work.union, work.union_count,
        p.cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), p.scale,
        p.scale * LOG2_E, **p.query_constants(q), num_warps=num_warps, num_stages=num_stages)
    return dq


def attention_dkdv(q, k, v, dout, lse, delta, p: SparseAttentionProblem, num_warps=8,
                   num_stages=2):
    """dk, dv, key-outer: one program per (key block, KV head), no atomics."""
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    blocks = p.block_work
    _sparse_attn_dkdv_kernel[(p.dkdv_order.numel(),)](
        q, k, v, dout, lse, delta, dk, dv, p.dkdv_order, blocks.pair_token,
        blocks.bucket_start, blocks.bucket_count, blocks.block_sequence, blocks.block_local,
        p.cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0),
        dv.stride(1), p.scale, p.scale * LOG2_E,
        HI=p.num_index_heads, GQ=p.gq, KV_GROUP=p.kv_group, NUM_KV_HEADS=p.num_kv_heads,
        TOK=p.key_tokens, ROWS=p.key_rows, BLOCK=p.block_size, HEAD_DIM=p.head_dim,
        PRECISION=_precision(q), num_warps=num_warps, num_stages=num_stages)
    return dk, dv


def sparse_attention_bwd(q, k, v, out, lse, dout, problem: SparseAttentionProblem):
    """Gradients dq [T, H, D], dk, dv [T, Hkv, D] (inputs' dtypes) of the sparse attention:
    dq query-outer, dk and dv key-outer; deterministic (every sum runs in a fixed order)."""
    delta = attention_delta(out, dout, problem)
    dq = attention_dq(q, k, v, dout, lse, delta, problem, **DQ_CONFIG)
    dk, dv = attention_dkdv(q, k, v, dout, lse, delta, problem, **DKDV_CONFIG)
    return dq, dk, dv


class SparseAttentionFunction(torch.autograd.Function):
    """Autograd over packed inputs: (q [T, H, D], k, v [T, Hkv, D], block_ids int32
    [T, Hi, top_k] token-major, cu_seqlens, block_size, scale) -> (out, lse2)."""

    @staticmethod
    def forward(ctx, q, k, v, block_ids, cu_seqlens, block_size, softmax_scale):
        problem = SparseAttentionProblem(q, k, block_ids, cu_seqlens, block_size, softmax_scale)
        out, lse = sparse_attention_fwd(q, k, v, problem)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.problem = problem
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = sparse_attention_bwd(q, k, v, out, lse, dout, ctx.problem)
        return dq, dk, dv, None, None, None, None
