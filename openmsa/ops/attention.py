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

Log-sum-exps are kept in base 2 of the scaled scores (``lse2 = log2 sum 2^(c * log2(e) * q.k)``),
so ``P = 2^(c * log2(e) * q.k - lse2)``; the natural-log LSE is ``lse2 * ln 2``.
See docs/KERNELS.md for the design, the alternatives measured and the figures.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .csr import BlockWork, QueryTileWork, build_block_work, build_query_tile_work

LOG2_E = math.log2(math.e)


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
    Q, K, V, DOUT, LSE, DELTA, DK_PART, DV_PART, SEGMENTS, SEGMENT_ORDER, PAIR_TOKEN,
    BUCKET_START, BUCKET_COUNT, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, scale_log2,
    HI: tl.constexpr, GQ: tl.constexpr, KV_GROUP: tl.constexpr, TOK: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    SEGMENT_PAIRS: tl.constexpr, PRECISION: tl.constexpr,
):
    """Key-outer dK, dV of one segment (up to SEGMENT_PAIRS (token, index head) pairs that kept
    one key block), taken in SEGMENT_ORDER (most pairs first); fp32 partials, unscaled dK."""
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
    head = index_head * GQ + rows % GQ
    for first_pair in range(first, last, TOK):
        pair = first_pair + rows // GQ
        valid = (rows < TOK * GQ) & (pair < last)
        token = tl.load(PAIR_TOKEN + pair, mask=valid, other=0).to(tl.int64)
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
        # first pairs of a bucket: they are in token order) need the causal mask.
        if tl.load(PAIR_TOKEN + first_pair) - seq_start < block * BLOCK + BLOCK - 1:
            query_pos = token - seq_start
            probs_t = tl.where(key_pos[:, None] <= query_pos[None, :], probs_t, 0.0)
        dv += tl.dot(probs_t.to(dout.dtype), dout, input_precision=PRECISION)
        dprobs_t = tl.dot(v, tl.trans(dout), input_precision=PRECISION)
        dscores_t = probs_t * (dprobs_t - delta[None, :])  # d loss / d (scaled logits)
        dk += tl.dot(dscores_t.to(q.dtype), q, input_precision=PRECISION)
    offsets = (segment * BLOCK + tl.arange(0, BLOCK))[:, None] * HEAD_DIM + dims[None, :]
    tl.store(DK_PART + offsets, dk)
    tl.store(DV_PART + offsets, dv)


@triton.jit
def _reduce_dkdv_kernel(
    DK_PART, DV_PART, DK, DV, BUCKET_SEGMENTS_END, BLOCK_SEQUENCE, BLOCK_LOCAL, CU_SEQLENS,
    stride_dk_t, stride_dk_h, stride_dv_t, stride_dv_h, scale,
    HI: tl.constexpr, KV_GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """dK, dV of one (key block, KV head): the sum of its segments' partials, in order."""
    global_block = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    sequence = tl.load(BLOCK_SEQUENCE + global_block).to(tl.int64)
    if sequence < 0:
        return
    block = tl.load(BLOCK_LOCAL + global_block).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start
    # The buckets of this KV head's index heads are contiguous, so are their segments.
    first_bucket = global_block * HI + kv_head * KV_GROUP
    first_segment = tl.load(BUCKET_SEGMENTS_END + first_bucket - 1, mask=first_bucket > 0,
                            other=0).to(tl.int64)
    end_segment = tl.load(BUCKET_SEGMENTS_END + first_bucket + KV_GROUP - 1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    keys = tl.arange(0, BLOCK)
    dk = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK, HEAD_DIM), tl.float32)
    for segment in range(first_segment, end_segment):
        offsets = (segment * BLOCK + keys)[:, None] * HEAD_DIM + dims[None, :]
        dk += tl.load(DK_PART + offsets)
        dv += tl.load(DV_PART + offsets)
    key_pos = block * BLOCK + keys.to(tl.int64)
    key_valid = (key_pos < seq_len)[:, None]
    tl.store(DK + (seq_start + key_pos)[:, None] * stride_dk_t + kv_head * stride_dk_h
             + dims[None, :], (dk * scale).to(DK.dtype.element_ty), mask=key_valid)
    tl.store(DV + (seq_start + key_pos)[:, None] * stride_dv_t + kv_head * stride_dv_h
             + dims[None, :], dv.to(DV.dtype.element_ty), mask=key_valid)


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
                                                      SEGMENT_PAIRS)

    def query_constants(self, q):
        return dict(HI=self.num_index_heads, GQ=self.gq, KV_GROUP=self.kv_group,
                    TOK=self.query_tokens, ROWS=self.query_rows, BLOCK=self.block_size,
                    HEAD_DIM=self.head_dim, TOP_K=self.top_k, TOPK_PAD=_pow2(self.top_k),
                    UNION_SLOTS=self.query_work.union.shape[-1], PRECISION=_precision(q))


# Launch configurations: the winners of benchmarks/bench_attention.py's sweep on an H200.
FWD_CONFIG = dict(num_warps=8, num_stages=2)
# Pairs per dK/dV program: bounds a program's work when many queries keep the same block.
SEGMENT_PAIRS = 2048
DQ_CONFIG = dict(num_warps=8, num_stages=2)
DKDV_CONFIG = dict(num_warps=8, num_stages=2)


def sparse_attention_fwd(q, k, v, problem: SparseAttentionProblem,
                         num_warps=FWD_CONFIG["num_warps"], num_stages=FWD_CONFIG["num_stages"]):
    """q: [T, H, D]; k, v: [T, Hkv, D]. Returns out [T, H, D] (q's dtype) and lse2 [T, H] fp32.

    Query-outer: each (query tile, index head) walks the distinct blocks its tokens kept."""
    p = problem
    out = torch.empty_like(q)
    lse = torch.empty(p.total, p.num_heads, dtype=torch.float32, device=q.device)
    work = p.query_work
    _sparse_attn_fwd_query_kernel[(work.schedule.shape[0], p.num_index_heads)](
        q, k, v, out, lse, p.block_ids, work.schedule, work.union, work.union_count,
        p.cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), out.stride(0), out.stride(1), p.scale * LOG2_E,
        **p.query_constants(q), num_warps=num_warps, num_stages=num_stages)
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
    """dk, dv, key-outer: fp32 partials per segment of pairs, then an in-order sum per block."""
    blocks = p.block_work
    num_segments = blocks.segments.shape[0]
    dk_part = torch.empty(num_segments * p.block_size, p.head_dim, dtype=torch.float32,
                          device=q.device)
    dv_part = torch.empty_like(dk_part)
    _sparse_attn_dkdv_kernel[(num_segments,)](
        q, k, v, dout, lse, delta, dk_part, dv_part, blocks.segments, blocks.segment_order,
        blocks.pair_token, blocks.bucket_start, blocks.bucket_count, blocks.block_sequence,
        blocks.block_local, p.cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), p.scale * LOG2_E,
        HI=p.num_index_heads, GQ=p.gq, KV_GROUP=p.kv_group, TOK=p.key_tokens, ROWS=p.key_rows,
        BLOCK=p.block_size, HEAD_DIM=p.head_dim, SEGMENT_PAIRS=blocks.segment_pairs,
        PRECISION=_precision(q), num_warps=num_warps, num_stages=num_stages)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _reduce_dkdv_kernel[(blocks.num_global_blocks, p.num_kv_heads)](
        dk_part, dv_part, dk, dv, blocks.bucket_segments_end, blocks.block_sequence,
        blocks.block_local, p.cu_seqlens, dk.stride(0), dk.stride(1), dv.stride(0),
        dv.stride(1), p.scale, HI=p.num_index_heads, KV_GROUP=p.kv_group,
        NUM_KV_HEADS=p.num_kv_heads, BLOCK=p.block_size, HEAD_DIM=p.head_dim, num_warps=4)
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
