"""Decode kernels (``msa_decode``, SPEC section 10): a few new query tokens per sequence against
long caches, split over the cache so that batch 1 fills the GPU.

- ``decode_block_scores``: one program per (sequence, index key head, run of BLOCKS_PER_PROGRAM
  cached blocks) scores all the sequence's new tokens x the key head's index heads against each
  block of the run (one MMA of ``Tq * G`` rows) and max-pools them: every cached index key is
  read once per step.
- ``decode_top_blocks``: one program per (sequence, index head, new token) keeps the forced
  blocks and the best others in ``naive.select_blocks_from_scores``'s order, by one max per slot
  over int64 keys that order as (score, lower block).
- ``decode_attention``: one program per (new token, index head, kept slot) attends the index
  head's main heads over that one block (flash-decoding's split over keys, here over kept
  blocks) and writes a partial (max, sum, accumulator); ``merge_partials`` combines the slots by
  their log-sum-exps and writes the output dtype.

Each is one launch, so a decode step is four kernels (a CUDA graph replays them without the
host's costs).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .interpreter import INTERPRETING
from .problem import LOG2_E
from .quantize import quantize_tile_e4m3


def score_launch(rows: int, fp8: bool) -> dict:
    """Cached blocks per program, warps and pipeline stages of a block-score launch, measured by
    benchmarks/bench_decode_kernels.py: 4 blocks, 4 warps, 2 stages for input-precision scores;
    fp8 walks 8 blocks with Triton's default warps and stages, or 8 warps and no pipelined loads
    where quantizing key blocks beside 128+ query rows would spill (ptxas, sm_90a)."""
    if not fp8:
        return dict(blocks_per_program=4, num_warps=4, num_stages=2)
    return dict(blocks_per_program=8, **(dict(num_warps=8, num_stages=1) if rows >= 128 else {}))


def top_blocks_warps(num_blocks_pow2: int) -> int:
    """Warps of a top-k program over ``num_blocks_pow2`` block keys."""
    return max(4, min(16, num_blocks_pow2 // 256))


# Programmatic dependent launch (Hopper on): each decode kernel lets the next one launch while
# it runs and waits (griddepcontrol) before reading what came before, so the launches'
# latency overlaps the previous kernel. Off by default until timed on the GPU
# (benchmarks/bench_decode_kernels.py times both); ``pdl=True`` turns it on per call.
DECODE_PDL = False


def _pdl_launch(pdl: bool | None, device: torch.device) -> tuple[bool, dict]:
    """(the kernels' PDL constexpr, the launch option) for a decode launch on ``device``: off
    on a CPU, under the interpreter and below sm_90 (no griddepcontrol)."""
    on = (DECODE_PDL if pdl is None else pdl) and device.type == "cuda" and not INTERPRETING
    on = on and _capability(device.index if device.index is not None
                            else torch.cuda.current_device()) >= 9
    return on, (dict(launch_pdl=True) if on else {})


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


ORDERED_NEG_INF = tl.constexpr(-2139095041)  # -inf's bits as the top-k's monotone int32
REMOVED = tl.constexpr(-(2**63))  # the key of a block already kept


@triton.jit
def _decode_block_scores_kernel(
    IQ, IKC, LENGTHS, SCORES, stride_iq_b, stride_iq_t, stride_iq_h, stride_ik_b, stride_ik_t,
    stride_ik_h, stride_s_b, stride_s_h, stride_s_t, scale, num_blocks,
    NEW: tl.constexpr, G: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
    FP8: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    """SCORES [B, Hi, NEW, blocks]: each block's max-pooled, scaled index score for every new
    token (row r: token r // G, index head key_head * G + r % G); -inf for blocks past the
    sequence's length. FP8: the scores of SPEC section 8, the rows of index_q and of each block
    of cached index keys quantized here (the codes are exact in fp16, so their products are
    exact and summed in fp32)."""
    b = tl.program_id(0).to(tl.int64)
    key_head = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    length = tl.load(LENGTHS + b).to(tl.int64)
    first = tl.program_id(2) * BLOCKS_PER_PROGRAM
    last = tl.minimum(first + BLOCKS_PER_PROGRAM, (length + BLOCK - 1) // BLOCK)
    end = tl.minimum(first + BLOCKS_PER_PROGRAM, num_blocks)
    rows = tl.arange(0, ROWS)
    token = rows // G
    head = key_head * G + rows % G
    row_valid = rows < NEW * G
    position = length - NEW + token  # [ROWS] the new token's position in its sequence
    dims = tl.arange(0, HEAD_DIM)
    iq = tl.load(IQ + b * stride_iq_b + token[:, None] * stride_iq_t + head[:, None] * stride_iq_h
                 + dims[None, :], mask=row_valid[:, None], other=0.0)
    row_scale = tl.full([ROWS], scale, tl.float32)
    if FP8:
        codes_dtype = tl.float32 if iq.dtype == tl.float32 else tl.float16
        iq_codes, iq_scale = quantize_tile_e4m3(iq)
        iq = iq_codes.to(codes_dtype)
        row_scale = row_scale * iq_scale
    key_offsets = tl.arange(0, BLOCK)
    ik_base = IKC + b * stride_ik_b + key_head * stride_ik_h
    for block in range(first, last):
        key_pos = block * BLOCK + key_offsets
        ik = tl.load(ik_base + key_pos[:, None].to(tl.int64) * stride_ik_t + dims[None, :],
                     mask=(key_pos < length)[:, None], other=0.0)
        if FP8:
            ik_codes, ik_scale = quantize_tile_e4m3(ik)
            scores = tl.dot(iq, tl.trans(ik_codes.to(codes_dtype)),
                            input_precision=PRECISION) * ik_scale[None, :]
        else:
            scores = tl.dot(iq, tl.trans(ik), input_precision=PRECISION)
        visible = (key_pos[None, :] <= position[:, None]) & (key_pos < length)[None, :]
        if NEGATIVE_SCALE:
            pooled = tl.min(tl.where(visible, scores, float("inf")), axis=1) * row_scale
        else:
            pooled = tl.max(tl.where(visible, scores, float("-inf")), axis=1) * row_scale
        tl.store(SCORES + b * stride_s_b + head * stride_s_h + token * stride_s_t + block,
                 pooled, mask=row_valid)
    for block in range(tl.maximum(last, first), end):
        tl.store(SCORES + b * stride_s_b + head * stride_s_h + token * stride_s_t + block,
                 tl.full([ROWS], float("-inf"), tl.float32), mask=row_valid)


@triton.jit
def _decode_top_blocks_kernel(
    SCORES, LENGTHS, IDS, stride_s_b, stride_s_h, stride_s_t, stride_ids_b, stride_ids_h,
    stride_ids_t, num_blocks, NEW: tl.constexpr, BLOCK: tl.constexpr, TOP_K: tl.constexpr,
    NUM_LOCAL: tl.constexpr, LOCAL_DILATION: tl.constexpr, NUM_SINK: tl.constexpr,
    BLOCKS_POW2: tl.constexpr, PDL: tl.constexpr = False,
):
    """IDS [B, Hi, NEW, TOP_K] of one (sequence, index head, new token) row: steps 3-4 of the
    selection in ``naive.select_blocks_from_scores``'s order (forced blocks in block order,
    then descending scores, ties to the lower block, -1 where no visible block is left)."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    token = tl.program_id(2)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    position = tl.load(LENGTHS + b).to(tl.int32) - NEW + token
    blocks = tl.arange(0, BLOCKS_POW2)
    scores = tl.load(SCORES + b * stride_s_b + head * stride_s_h + token * stride_s_t + blocks,
                     mask=blocks < num_blocks, other=float("-inf"))
    behind = position // BLOCK - blocks
    local = ((behind % LOCAL_DILATION) == 0) & (behind < NUM_LOCAL * LOCAL_DILATION)
    forced = (behind >= 0) & (local | (blocks < NUM_SINK))
    scores = tl.where(forced, float("inf"), scores)
    # One int64 key per block that orders as (score, then the lower block) does: the score's
    # bits made monotone as a signed integer in the high half, the block's complement in the
    # low half. One max per slot then finds the next kept block.
    bits = scores.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    keys = (ordered << 32) | (4294967295 - blocks.to(tl.int64))
    out = IDS + b * stride_ids_b + head * stride_ids_h + token * stride_ids_t
    for slot in tl.static_range(TOP_K):
        best = tl.max(keys, axis=0)
        block = (4294967295 - (best - ((best >> 32) << 32))).to(tl.int32)
        # Blocks scored -inf (invisible) and the removed ones are never kept.
        tl.store(out + slot, tl.where((best >> 32) > ORDERED_NEG_INF, block, -1))
        keys = tl.where(keys == best, REMOVED, keys)


@triton.jit
def _decode_attention_kernel(
    Q, KC, VC, IDS, LENGTHS, MAXES, SUMS, ACCS, stride_q_b, stride_q_t, stride_q_h, stride_k_b,
    stride_k_t, stride_k_h, stride_ids_b, stride_ids_h, stride_ids_t, scale_log2,
    NEW: tl.constexpr, GQ: tl.constexpr, ROWS: tl.constexpr, KV_GROUP: tl.constexpr,
    NUM_HEADS: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    """Partials of one (new token, index head, kept slot): its main heads' max (base 2), sum of
    exponentials and accumulator over the slot's block, into MAXES, SUMS [B * NEW, H, SLOTS]
    and ACCS [B * NEW, H, SLOTS, D] (max -inf and zeros for an unused slot)."""
    row = tl.program_id(0).to(tl.int64)  # b * NEW + token
    index_head = tl.program_id(1)
    slot = tl.program_id(2)
    b = row // NEW
    token = row % NEW
    rows = tl.arange(0, ROWS)
    heads = index_head * GQ + rows
    head_valid = rows < GQ
    dims = tl.arange(0, HEAD_DIM)
    out_rows = (row * NUM_HEADS + heads) * SLOTS + slot
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    block = tl.load(IDS + b * stride_ids_b + index_head * stride_ids_h + token * stride_ids_t
                    + slot)
    if block < 0:
        tl.store(MAXES + out_rows, tl.full([ROWS], float("-inf"), tl.float32), mask=head_valid)
        tl.store(SUMS + out_rows, tl.zeros([ROWS], tl.float32), mask=head_valid)
        tl.store(ACCS + out_rows[:, None] * HEAD_DIM + dims[None, :],
                 tl.zeros([ROWS, HEAD_DIM], tl.float32), mask=head_valid[:, None])
        return
    length = tl.load(LENGTHS + b).to(tl.int64)
    position = length - NEW + token
    kv_head = index_head // KV_GROUP
    q = tl.load(Q + b * stride_q_b + token * stride_q_t + heads[:, None] * stride_q_h
                + dims[None, :], mask=head_valid[:, None], other=0.0)
    key_pos = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    visible = (key_pos <= position) & (key_pos < length)
    offsets = (b * stride_k_b + key_pos[:, None] * stride_k_t + kv_head * stride_k_h
               + dims[None, :])
    k = tl.load(KC + offsets, mask=visible[:, None], other=0.0)
    v = tl.load(VC + offsets, mask=visible[:, None], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    scores = tl.where(visible[None, :], scores, float("-inf"))
    block_max = tl.max(scores, axis=1)
    safe_max = tl.where(block_max == float("-inf"), 0.0, block_max)
    probs = tl.exp2(scores - safe_max[:, None])
    acc = tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
    tl.store(MAXES + out_rows, block_max, mask=head_valid)
    tl.store(SUMS + out_rows, tl.sum(probs, axis=1), mask=head_valid)
    tl.store(ACCS + out_rows[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_valid[:, None])


def _precision(tensor: torch.Tensor) -> str:
    return "ieee" if tensor.dtype == torch.float32 else "tf32"


def decode_block_scores(index_q, index_k_cache, lengths, block_size: int,
                        index_softmax_scale: float, index_precision: str = "input", *,
                        blocks_per_program: int | None = None,
                        launch: dict | None = None, pdl: bool | None = None) -> torch.Tensor:
    """fp32 ``[B, Hi, Tq, blocks]``: each cached block's max-pooled, scaled index score for
    every new token (-inf where no key of the block is visible to it), from input-precision
    or fp8 index scores. ``blocks_per_program`` and ``launch`` (``num_warps``,
    ``num_stages``) override ``score_launch``'s measured launch
    (benchmarks/bench_decode_kernels.py sweeps them); ``pdl``: programmatic dependent launch
    (None: ``DECODE_PDL``)."""
    batch, new, num_index_heads, head_dim = index_q.shape
    capacity, num_key_heads = index_k_cache.shape[1], index_k_cache.shape[2]
    group = num_index_heads // num_key_heads
    num_blocks = -(-capacity // block_size)
    scores = torch.empty((batch, num_index_heads, new, num_blocks), dtype=torch.float32,
                         device=index_q.device)
    index_q = index_q if index_q.stride(-1) == 1 else index_q.contiguous()
    index_k_cache = index_k_cache if index_k_cache.stride(-1) == 1 else index_k_cache.contiguous()
    rows = max(16, triton.next_power_of_2(new * group))
    fp8 = index_precision == "fp8"
    config = score_launch(rows, fp8)
    per_program = config.pop("blocks_per_program")
    if blocks_per_program is not None:
        per_program = blocks_per_program
    if launch is not None:
        config = launch
    grid = (batch, num_key_heads, triton.cdiv(num_blocks, per_program))
    pdl, pdl_launch = _pdl_launch(pdl, index_q.device)
    _decode_block_scores_kernel[grid](
        index_q, index_k_cache, lengths, scores, index_q.stride(0), index_q.stride(1),
        index_q.stride(2), index_k_cache.stride(0), index_k_cache.stride(1),
        index_k_cache.stride(2), scores.stride(0), scores.stride(1), scores.stride(2),
        index_softmax_scale, num_blocks, NEW=new, G=group, ROWS=rows, BLOCK=block_size,
        HEAD_DIM=head_dim, BLOCKS_PER_PROGRAM=per_program,
        NEGATIVE_SCALE=index_softmax_scale < 0, FP8=fp8, PRECISION=_precision(index_q),
        PDL=pdl, **config, **pdl_launch)
    return scores


def decode_select(index_q, index_k_cache, lengths, *, top_k: int, block_size: int,
                  index_softmax_scale: float, num_local_blocks: int, num_sink_blocks: int,
                  index_precision: str = "input", local_block_dilation: int = 1,
                  pdl: bool | None = None) -> torch.Tensor:
    """Kept block ids int32 ``[B, Hi, Tq, top_k]`` of the new tokens (SPEC section 3 steps 1-4
    at positions ``lengths[b] - Tq ...``)."""
    scores = decode_block_scores(index_q, index_k_cache, lengths, block_size,
                                 index_softmax_scale, index_precision, pdl=pdl)
    return decode_top_blocks(scores, lengths, top_k=top_k, block_size=block_size,
                             num_local_blocks=num_local_blocks, num_sink_blocks=num_sink_blocks,
                             local_block_dilation=local_block_dilation, pdl=pdl)


def decode_top_blocks(scores, lengths, *, top_k: int, block_size: int, num_local_blocks: int,
                      num_sink_blocks: int, local_block_dilation: int = 1,
                      num_warps: int | None = None, pdl: bool | None = None) -> torch.Tensor:
    """Steps 3-4 on block scores ``[B, Hi, Tq, blocks]`` of the new tokens (the last ``Tq`` of
    each sequence's ``lengths[b]``): int32 ids ``[B, Hi, Tq, top_k]``, one program per row."""
    batch, num_index_heads, new, num_blocks = scores.shape
    ids = torch.empty(batch, num_index_heads, new, top_k, dtype=torch.int32,
                      device=scores.device)
    pow2 = triton.next_power_of_2(num_blocks)
    pdl, pdl_launch = _pdl_launch(pdl, scores.device)
    _decode_top_blocks_kernel[(batch, num_index_heads, new)](
        scores, lengths, ids, scores.stride(0), scores.stride(1), scores.stride(2),
        ids.stride(0), ids.stride(1), ids.stride(2), num_blocks, NEW=new, BLOCK=block_size,
        TOP_K=top_k, NUM_LOCAL=num_local_blocks, LOCAL_DILATION=local_block_dilation,
        NUM_SINK=num_sink_blocks, BLOCKS_POW2=pow2, PDL=pdl,
        num_warps=top_blocks_warps(pow2) if num_warps is None else num_warps, **pdl_launch)
    return ids


def decode_attention(q, k_cache, v_cache, block_ids, lengths, block_size: int,
                     softmax_scale: float, pdl: bool | None = None) -> torch.Tensor:
    """``out [B, Tq, H, D]`` (q's dtype) of the new tokens over their kept blocks
    (``block_ids [B, Hi, Tq, k]``): partials per slot, merged by their log-sum-exps."""
    batch, new, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    num_index_heads, slots = block_ids.shape[1], block_ids.shape[3]
    gq = num_heads // num_index_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():  # one set of strides
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    block_ids = block_ids.contiguous()
    maxes = torch.empty(batch * new, num_heads, slots, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    accs = torch.empty(batch * new, num_heads, slots, head_dim, dtype=torch.float32,
                       device=q.device)
    pdl, pdl_launch = _pdl_launch(pdl, q.device)
    _decode_attention_kernel[(batch * new, num_index_heads, slots)](
        q, k_cache, v_cache, block_ids, lengths, maxes, sums, accs, q.stride(0), q.stride(1),
        q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_ids.stride(0), block_ids.stride(1), block_ids.stride(2),
        softmax_scale * LOG2_E, NEW=new, GQ=gq, ROWS=max(16, triton.next_power_of_2(gq)),
        KV_GROUP=num_index_heads // num_kv_heads, NUM_HEADS=num_heads, SLOTS=slots,
        BLOCK=block_size, HEAD_DIM=head_dim, PRECISION=_precision(q), PDL=pdl, **pdl_launch)
    merged = merge_partials(maxes.view(-1, slots), sums.view(-1, slots),
                            accs.view(-1, slots, head_dim), q.dtype, pdl)
    return merged.view(batch, new, num_heads, head_dim)


@triton.jit
def _merge_partials_kernel(MAXES, SUMS, ACCS, OUT, SLOTS: tl.constexpr,
                           SLOTS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr,
                           PDL: tl.constexpr = False):
    """OUT row (new token, head) = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the
    row's slots (the own block is always kept, so M is finite)."""
    row = tl.program_id(0).to(tl.int64)
    slots = tl.arange(0, SLOTS_POW2)
    dims = tl.arange(0, HEAD_DIM)
    valid = slots < SLOTS
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    maxes = tl.load(MAXES + row * SLOTS + slots, mask=valid, other=float("-inf"))
    sums = tl.load(SUMS + row * SLOTS + slots, mask=valid, other=0.0)
    accs = tl.load(ACCS + (row * SLOTS + slots[:, None]) * HEAD_DIM + dims[None, :],
                   mask=valid[:, None], other=0.0)
    weights = tl.exp2(maxes - tl.max(maxes, axis=0))  # unused slots: 2^-inf = 0
    out = tl.sum(weights[:, None] * accs, axis=0) / tl.sum(weights * sums, axis=0)
    tl.store(OUT + row * HEAD_DIM + dims, out.to(OUT.dtype.element_ty))


def merge_partials(maxes, sums, accs, dtype, pdl: bool | None = None) -> torch.Tensor:
    """The slots' partials ``[R, SLOTS]``, ``[R, SLOTS]``, ``[R, SLOTS, D]`` merged by their
    log-sum-exps into ``[R, D]`` of ``dtype``."""
    rows, slots, head_dim = accs.shape
    out = torch.empty(rows, head_dim, dtype=dtype, device=accs.device)
    pdl, pdl_launch = _pdl_launch(pdl, accs.device)
    _merge_partials_kernel[(rows,)](maxes, sums, accs, out, SLOTS=slots,
                                    SLOTS_POW2=max(16, triton.next_power_of_2(slots)),
                                    HEAD_DIM=head_dim, PDL=pdl, **pdl_launch)
    return out
