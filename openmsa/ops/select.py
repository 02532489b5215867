"""Fused index scoring, block max-pool and top-k block selection (SPEC section 3, steps 1-4).

One program owns a tile of ``TILE_TOKENS`` consecutive query tokens of one sequence times the
``G = Hi / Hik`` index heads that share one index key head: ``G * TILE_TOKENS`` rows of one MMA.
It walks the sequence's key blocks from the first to the tile's own block. For each block it
computes the scores ``[rows, BLOCK]`` on the tensor cores, max-pools them to one score per row
and merges that into a per-row top-k kept in registers. Block scores never reach memory; the only
output is the kept block ids. See docs/KERNELS.md for the design.

Top-k bookkeeping: each candidate becomes one int64 key ``(order-preserving score bits << 32) |
(MAX_ID - block id)``. Keys are unique, a larger key is a better block, and equal scores prefer the
lower id, as the SPEC asks. Forced blocks get the score +inf so they enter and are never evicted.
A new key replaces the row's smallest key when it is larger.

``index_precision="fp8"`` (SPEC section 8): the kernel reads e4m3 codes and fp32 row scales
(``openmsa.ops.quantize``) and scores ``scale * s_q * max_j(s_k[j] * <q8, k8[j]>)`` on the fp8
tensor cores. Under the CPU interpreter, whose fp8 casts and dots are wrong, the same codes
travel as fp32 values (each e4m3 value is exact in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import SELECT_CONFIG, SELECT_MAX_REGISTERS
from .quantize import quantize_rows_e4m3_fused
from .worklists import query_tile_schedule


@triton.jit
def _order_preserving_bits(score):
    """fp32 -> int32 whose signed order is the float order."""
    bits = score.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# _order_preserving_bits(-inf): the key bits of a block that no visible key scores.
_NEGATIVE_INFINITY_BITS = tl.constexpr(-0x7F800001)


@triton.jit
def _merge_block(keys, block_score, block_id, forced):
    """Merges one candidate block per row into the rows' top-k keys [ROWS, TOPK_SLOTS]."""
    score_bits = tl.where(forced, 0x7F800000, _order_preserving_bits(block_score))  # +inf bits
    candidate = (score_bits.to(tl.int64) << 32) | (0x7FFFFFFF - block_id)
    smallest = tl.min(keys, axis=1)
    replace = (keys == smallest[:, None]) & (candidate > smallest)[:, None]
    return tl.where(replace, candidate[:, None], keys)


@triton.jit
def _key_scales(ik_scale_base, block, key_offsets, stride_iks_t, num_blocks,
                BLOCK: tl.constexpr, QUANTIZED: tl.constexpr):
    """fp8: the scales [BLOCK] of a block's keys (1 past ``num_blocks``); else ones (unread)."""
    if QUANTIZED:
        scales = tl.load(ik_scale_base + (block * BLOCK + key_offsets) * stride_iks_t,
                         mask=block < num_blocks, other=1.0)
    else:
        scales = tl.full([BLOCK], 1.0, tl.float32)
    return scales


@triton.jit
def _block_score(iq, ik_base, key_scale, block, key_offsets, dims, stride_ik_t, scale,
                 BLOCK: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, PRECISION: tl.constexpr,
                 QUANTIZED: tl.constexpr, IMPRECISE_ACC: tl.constexpr):
    """The rows' scaled max-pooled scores of a block before their own (every key visible).
    ``scale``: [ROWS] (fp8: the index scale times the rows' scales) or a scalar; ``key_scale``:
    fp8, the keys' scales [BLOCK]."""
    key_pos = block * BLOCK + key_offsets
    ik = tl.load(ik_base + key_pos[:, None] * stride_ik_t + dims[None, :])  # [BLOCK, D]
    scores = tl.dot(iq, tl.trans(ik), input_precision=PRECISION,
                    max_num_imprecise_acc=IMPRECISE_ACC)  # [ROWS, BLOCK]
    if QUANTIZED:
        scores = scores * key_scale[None, :]
    if NEGATIVE_SCALE:
        return tl.min(scores, axis=1) * scale
    return tl.max(scores, axis=1) * scale


@triton.jit
def _select_fwd_kernel(
    IQ, IK, IQ_SCALE, IK_SCALE, IDS, ROW_MAX, CU_SEQLENS, SCHEDULE, query_start, query_end,
    stride_iq_t, stride_iq_h, stride_ik_t, stride_ik_h, stride_ids_t, stride_ids_h,
    stride_iqs_t, stride_iks_t, scale,
    G: tl.constexpr, TILE_TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TOP_K: tl.constexpr, TOPK_SLOTS: tl.constexpr, NUM_LOCAL: tl.constexpr,
    LOCAL_DILATION: tl.constexpr, NUM_SINK: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, WITH_MAX: tl.constexpr,
    PRECISION: tl.constexpr, QUANTIZED: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
):
    """QUANTIZED: IQ and IK hold e4m3 codes, IQ_SCALE [Tq, Hi] and IK_SCALE [T, Hik] their
    rows' scales; IMPRECISE_ACC: the fp8 products the tensor cores sum before each sum is
    added in full fp32 precision (None: the whole dot; Hopper sums fp8 products with fewer
    mantissa bits than fp32). WITH_MAX: also each row's largest scaled score over its visible
    keys (the largest block score), into ROW_MAX; exact when TOP_K leaves a slot beside the
    forced blocks (else the largest over the kept and forced blocks)."""
    entry = tl.program_id(0).to(tl.int64)
    key_head = tl.program_id(1).to(tl.int64)
    sequence = tl.load(SCHEDULE + 2 * entry).to(tl.int64)
    if sequence < 0:
        return
    tile = tl.load(SCHEDULE + 2 * entry + 1).to(tl.int64)
    seq_start = tl.load(CU_SEQLENS + sequence).to(tl.int64)
    seq_len = tl.load(CU_SEQLENS + sequence + 1).to(tl.int64) - seq_start

    # The queries are the packed tokens [query_start, query_end): positions [first, end) here.
    first_query = tl.maximum(query_start - seq_start, 0)
    end_query = tl.minimum(query_end - seq_start, seq_len)

    rows = tl.arange(0, ROWS)
    token = tile * TILE_TOKENS + rows // G  # [ROWS] position in the sequence
    head = key_head * G + rows % G  # [ROWS] index head
    # ROWS is G * TILE_TOKENS padded to a power of two.
    row_valid = (rows < G * TILE_TOKENS) & (token >= first_query) & (token < end_query)
    query_row = seq_start - query_start + token  # [ROWS] row in index_q and the ids
    dims = tl.arange(0, HEAD_DIM)
    iq = tl.load(IQ + query_row[:, None] * stride_iq_t + head[:, None] * stride_iq_h
                 + dims[None, :], mask=row_valid[:, None], other=0.0)  # [ROWS, D]
    if QUANTIZED:  # one factor per row: the index scale times the row's scale
        scale = scale * tl.load(IQ_SCALE + query_row * stride_iqs_t + head, mask=row_valid,
                                other=1.0)

    # Every token of the tile lies in one block: BLOCK is a multiple of TILE_TOKENS.
    own_block = ((tile * TILE_TOKENS) // BLOCK).to(tl.int32)
    last_token = tl.minimum(tile * TILE_TOKENS + TILE_TOKENS, seq_len) - 1  # [ ] scalar
    slots = tl.arange(0, TOPK_SLOTS).to(tl.int64)
    # Empty slots hold distinct, very small keys; padding slots past TOP_K hold the largest key so
    # they are never the row minimum and never replaced.
    keys = tl.where(slots[None, :] < TOP_K, slots[None, :] - 0x7FFFFFFFFFFFFFFF,
                    0x7FFFFFFFFFFFFFFF)
    keys = tl.broadcast_to(keys, (ROWS, TOPK_SLOTS))

    key_offsets = tl.arange(0, BLOCK).to(tl.int64)  # int64: positions x strides can pass 2^31
    ik_base = IK + seq_start * stride_ik_t + key_head * stride_ik_h
    ik_scale_base = IK_SCALE + seq_start * stride_iks_t + key_head
    # fp8: each block's key scales are loaded one block ahead, so that the load's latency hides
    # behind the block before instead of stalling every iteration.
    next_key_scale = _key_scales(ik_scale_base, 0, key_offsets, stride_iks_t, own_block, BLOCK,
                                 QUANTIZED)
    for block in range(0, own_block):  # blocks before the own block are fully visible
        key_scale = next_key_scale
        if QUANTIZED:  # (otherwise a constant, not carried through the loop)
            next_key_scale = _key_scales(ik_scale_base, block + 1, key_offsets, stride_iks_t,
                                         own_block, BLOCK, QUANTIZED)
        pooled = _block_score(iq, ik_base, key_scale, block, key_offsets, dims, stride_ik_t,
                              scale, BLOCK, NEGATIVE_SCALE, PRECISION, QUANTIZED, IMPRECISE_ACC)
        behind = own_block - block
        forced = (((behind % LOCAL_DILATION) == 0) & (behind < NUM_LOCAL * LOCAL_DILATION)
                  | (block < NUM_SINK))
        keys = _merge_block(keys, pooled, block, forced)

    # The own block: causal mask, always forced.
    key_pos = own_block * BLOCK + key_offsets
    ik = tl.load(ik_base + key_pos[:, None] * stride_ik_t + dims[None, :],
                 mask=(key_pos <= last_token)[:, None], other=0.0)
    scores = tl.dot(iq, tl.trans(ik), input_precision=PRECISION,
                    max_num_imprecise_acc=IMPRECISE_ACC)
    if QUANTIZED:
        scores = scores * tl.load(ik_scale_base + key_pos * stride_iks_t,
                                  mask=key_pos <= last_token, other=1.0)[None, :]
    visible = key_pos[None, :] <= token[:, None]
    if NEGATIVE_SCALE:
        pooled = tl.min(tl.where(visible, scores, float("inf")), axis=1) * scale
    else:
        pooled = tl.max(tl.where(visible, scores, float("-inf")), axis=1) * scale
    keys = _merge_block(keys, pooled, own_block, rows >= 0)
    # A slot is unused while it holds its initial key, or a block of score -inf (never kept).
    score_bits = (keys >> 32).to(tl.int32)
    unused = (keys < TOP_K - 0x7FFFFFFFFFFFFFFF) | (score_bits == _NEGATIVE_INFINITY_BITS)
    if WITH_MAX:
        # The best unforced block, when a slot is left for it, is among the kept keys: its
        # score comes back from the key's bits (the bit map is its own inverse). Forced blocks'
        # keys hold +inf instead of their scores, so those (the own block's is at hand) are
        # scored again, which needs fewer registers than a running maximum in the loop.
        unforced = ~unused & (score_bits != 0x7F800000)
        kept_score = _order_preserving_bits(score_bits).to(tl.float32, bitcast=True)
        row_max = tl.maximum(tl.max(tl.where(unforced, kept_score, float("-inf")), axis=1),
                             pooled)
        # The local blocks before the own one: own_block - d, - 2d, ... while in the sequence.
        local_steps = tl.minimum(NUM_LOCAL - 1, own_block // LOCAL_DILATION)
        for step in range(1, local_steps + 1):
            block = own_block - step * LOCAL_DILATION
            row_max = tl.maximum(row_max, _block_score(
                iq, ik_base, _key_scales(ik_scale_base, block, key_offsets, stride_iks_t,
                                         own_block, BLOCK, QUANTIZED),
                block, key_offsets, dims, stride_ik_t, scale, BLOCK, NEGATIVE_SCALE, PRECISION,
                QUANTIZED, IMPRECISE_ACC))
        # Sinks, once more where one is also a local block (a maximum does not mind).
        for block in range(0, tl.minimum(NUM_SINK, own_block)):
            row_max = tl.maximum(row_max, _block_score(
                iq, ik_base, _key_scales(ik_scale_base, block, key_offsets, stride_iks_t,
                                         own_block, BLOCK, QUANTIZED),
                block, key_offsets, dims, stride_ik_t, scale, BLOCK, NEGATIVE_SCALE, PRECISION,
                QUANTIZED, IMPRECISE_ACC))
        # ROW_MAX is [Tq, Hi], Hi = G x the grid's key heads.
        tl.store(ROW_MAX + query_row * (G * tl.num_programs(1)) + head, row_max,
                 mask=row_valid)

    block_ids = 0x7FFFFFFF - keys.to(tl.int32)  # the low 32 bits
    block_ids = tl.where(unused, -1, block_ids)
    tl.store(IDS + query_row[:, None] * stride_ids_t + head[:, None] * stride_ids_h
             + slots[None, :], block_ids, mask=row_valid[:, None] & (slots[None, :] < TOP_K))


def _tile_tokens(index_heads_per_key_head: int, block_size: int, tile_rows: int) -> int:
    """Tokens per program: a power of two dividing the block, giving about ``tile_rows`` MMA
    rows (G heads x tokens)."""
    tokens = 1
    while tokens * 2 <= block_size and tokens * 2 * index_heads_per_key_head <= tile_rows:
        tokens *= 2
    return tokens


def select_blocks_fwd(index_q: torch.Tensor, index_k: torch.Tensor, cu_seqlens: torch.Tensor,
                      *, top_k: int, block_size: int, index_softmax_scale: float,
                      num_local_blocks: int, num_sink_blocks: int, query_start: int = 0,
                      index_precision: str = "input", local_block_dilation: int = 1,
                      tile_rows: int | None = None,
                      num_warps: int | None = None, num_stages: int | None = None,
                      imprecise_acc: int | None | str = "config", return_max: bool = False):
    """Kept block ids for packed inputs.

    index_q: [Tq, Hi, Di], the packed tokens [query_start, query_start + Tq) of the packing
    that index_k [T, Hik, Di] and cu_seqlens (int32 [N + 1]) describe (by default all of them).
    Returns int32 [Tq, Hi, top_k], block ids relative to each sequence's start, -1 unused, and
    with ``return_max`` also fp32 [Tq, Hi], each row's largest scaled index score over its
    visible keys (when ``top_k > num_local_blocks + num_sink_blocks``; else over the kept
    blocks only), which is then also its largest kept score.
    ``index_precision="fp8"``: rank the fp8 scores of SPEC section 8 (quantized here, in a
    pass over index_q and index_k); no ``return_max`` then, as the row maxima would be fp8
    scores and their users need the input-precision ones.
    ``tile_rows``, ``num_warps``, ``num_stages`` and (fp8) ``imprecise_acc`` tune the kernel;
    the defaults (``configs.SELECT_CONFIG``) won the sweep of benchmarks/bench_select.py.
    """
    config = SELECT_CONFIG[index_precision]
    tile_rows = tile_rows or config["tile_rows"]
    num_warps = num_warps or config["num_warps"]
    num_stages = num_stages or config["num_stages"]
    total, num_index_heads, head_dim = index_q.shape
    num_key_heads = index_k.shape[1]
    heads_per_key_head = num_index_heads // num_key_heads
    interpreting = index_q.device.type == "cpu"  # the Triton interpreter
    quantized = index_precision == "fp8"
    if quantized:
        if return_max:
            raise ValueError("return_max: expected False with index_precision='fp8' (the row "
                             "maxima would be of fp8 scores), received True")
        (index_q, q_scale), (index_k, k_scale) = (quantize_rows_e4m3_fused(t)
                                                  for t in (index_q, index_k))
        if interpreting:
            index_q, index_k = index_q.float(), index_k.float()
    if index_q.stride(-1) != 1:
        index_q = index_q.contiguous()
    if index_k.stride(-1) != 1:
        index_k = index_k.contiguous()
    if not quantized:
        q_scale, k_scale = index_q, index_k  # unread placeholders
    ids = torch.empty(total, num_index_heads, top_k, dtype=torch.int32, device=index_q.device)
    row_max = (torch.empty(total, num_index_heads, dtype=torch.float32, device=index_q.device)
               if return_max else ids)  # a placeholder without
    tile_tokens = _tile_tokens(heads_per_key_head, block_size, tile_rows)
    schedule = query_tile_schedule(cu_seqlens, total, tile_tokens, query_start)
    precision = "ieee" if index_q.dtype == torch.float32 else "tf32"
    grid = (schedule.shape[0], num_key_heads)
    _select_fwd_kernel[grid](
        index_q, index_k, q_scale, k_scale, ids, row_max, cu_seqlens, schedule, query_start,
        query_start + total,
        index_q.stride(0), index_q.stride(1), index_k.stride(0), index_k.stride(1),
        ids.stride(0), ids.stride(1), num_index_heads, num_key_heads,
        index_softmax_scale,
        G=heads_per_key_head, TILE_TOKENS=tile_tokens,
        ROWS=max(16, triton.next_power_of_2(heads_per_key_head * tile_tokens)),
        BLOCK=block_size, HEAD_DIM=head_dim,
        TOP_K=top_k, TOPK_SLOTS=max(2, triton.next_power_of_2(top_k)),
        NUM_LOCAL=num_local_blocks, LOCAL_DILATION=local_block_dilation,
        NUM_SINK=num_sink_blocks,
        NEGATIVE_SCALE=index_softmax_scale < 0, WITH_MAX=return_max, PRECISION=precision,
        QUANTIZED=quantized,
        IMPRECISE_ACC=config.get("imprecise_acc") if imprecise_acc == "config" else imprecise_acc,
        num_warps=num_warps, num_stages=1 if interpreting else num_stages,
        # The row maximum's epilogue raised ptxas's allocation from 124 to 191 registers per
        # thread, halving the programs per SM; capped, it spills 24 bytes (sm_90a).
        **(dict(maxnreg=SELECT_MAX_REGISTERS) if return_max and not interpreting else {}),
    )
    return (ids, row_max) if return_max else ids
