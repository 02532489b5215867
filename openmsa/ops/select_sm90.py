"""The fp8 selection for Hopper GPUs, in Gluon: ``select._select_fwd_kernel``'s program (SPEC
section 8 scores, block max-pool, top-k merge) with what Triton cannot express.

- Warp specialization: one loader warp brings each key block's e4m3 codes and fp32 scales by
  TMA into a ring of shared memory; two consumer warpgroups score 64 of the tile's 128 rows each
  against every block.
- Each block's product runs as two 64-dim halves into two accumulators, added in fp32 together
  with the key scales (one multiply and one fused multiply-add per score). Hopper's tensor cores
  sum fp8 products in fewer mantissa bits than fp32; adding the halves in fp32 is the Triton
  kernel's ``imprecise_acc=64``, without Triton's extra full accumulator and its serialized
  products.
- Block u's products are issued before block u - 1's max-pool and top-k merge, which run while
  the tensor cores compute.

The ranking, ties, forced blocks and ``-1`` slots are the Triton kernel's (``select._merge_block``
is shared). ``select.select_blocks_fwd`` runs this kernel where ``supported`` says so; the CPU
interpreter, other GPUs and the input-precision selection run the Triton kernel.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import sm90
TILE_ROWS = 128  # MMA rows of a program: G index heads x tokens, 64 per consumer warpgroup
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64, 128)
MAX_TOPK_SLOTS = 32  # the top-k keys of a thread's two rows stay in registers


@gluon.jit
def _order_preserving_bits(score):
    """fp32 -> int32 whose signed order is the float order (as select's)."""
    bits = score.to(gl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@gluon.jit
def _merge_block(keys, block_score, block_id, forced):
    """select._merge_block: one candidate block per row into the rows' top-k keys."""
    score_bits = gl.where(forced, 0x7F800000, _order_preserving_bits(block_score))
    candidate = (score_bits.to(gl.int64) << 32) | (0x7FFFFFFF - block_id)
    smallest = gl.min(keys, axis=1)
    replace = (keys == smallest[:, None]) & (candidate > smallest)[:, None]
    return gl.where(replace, candidate[:, None], keys)


@gluon.jit
def _select_loads(k_desc, scale_desc, k_smem, scale_smem, full, empty, seq_start, key_head,
                  scale_row, walk_length, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                  K_CHUNKS: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp: block u's codes (K_CHUNKS boxes of HEAD_DIM / K_CHUNKS dims) and its
    key scales into stage u % STAGES, once both consumer warpgroups handed the stage back."""
    CHUNK: gl.constexpr = HEAD_DIM // K_CHUNKS
    for u in range(0, walk_length):
        stage = u % STAGES
        mbarrier.wait(empty.index(stage), ((u // STAGES) & 1) ^ 1)
        mbarrier.expect(full.index(stage),
                        K_CHUNKS * k_desc.block_type.nbytes + scale_desc.block_type.nbytes)
        row = (seq_start + u * BLOCK).to(gl.int32)
        for chunk in gl.static_range(K_CHUNKS):
            tma.async_copy_global_to_shared(k_desc, [row, key_head * HEAD_DIM + chunk * CHUNK],
                                            full.index(stage),
                                            k_smem.index(K_CHUNKS * stage + chunk))
        tma.async_copy_global_to_shared(scale_desc, [scale_row + u * BLOCK], full.index(stage),
                                        scale_smem.index(stage))


@gluon.jit
def _issue_part(q_smem, k_smem, full, u, part, no_scores, K_CHUNKS: gl.constexpr,
                KEYS: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr):
    """The products of this warpgroup's 64 rows with keys [part KEYS, part KEYS + KEYS) of
    block u, one per chunk of dims into its own accumulator (asynchronous), once the block's
    stage landed."""
    stage = u % STAGES
    if part == 0:
        mbarrier.wait(full.index(stage), (u // STAGES) & 1)
    accumulators = ()
    for chunk in gl.static_range(K_CHUNKS):
        keys = k_smem.index(K_CHUNKS * stage + chunk).slice(part * KEYS, KEYS)
        accumulators = accumulators + (warpgroup_mma(
            q_smem.index(chunk).slice(HALF * 64, 64), keys.permute((1, 0)), no_scores,
            use_acc=False, is_async=True),)
    return accumulators


@gluon.jit
def _part_scores(accumulators, scale_smem, empty, u, part, own_block, positions,
                 K_CHUNKS: gl.constexpr, KEYS: gl.constexpr, KEY_PARTS: gl.constexpr,
                 BLOCK: gl.constexpr, STAGES: gl.constexpr, HIDDEN: gl.constexpr,
                 s_layout: gl.constexpr):
    """Keys [part KEYS, part KEYS + KEYS) of block u: the rows' scores without their scales
    (the chunks' sums added in fp32, with the key scales), once the products are done; the own
    block's keys after a row's token are HIDDEN. Hands the stage back after the last part."""
    accumulators = warpgroup_mma_wait(num_outstanding=0, deps=accumulators)
    stage = u % STAGES
    key_scale = scale_smem.index(stage).slice(part * KEYS, KEYS).load(
        gl.SliceLayout(0, s_layout))[None, :]
    if part == KEY_PARTS - 1:
        mbarrier.arrive(empty.index(stage), count=1)
    scores = accumulators[0] * key_scale
    for chunk in gl.static_range(1, K_CHUNKS):
        scores = accumulators[chunk] * key_scale + scores
    if u == own_block:  # the causal mask (only the last block)
        key_pos = u * BLOCK + part * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
        scores = gl.where(key_pos[None, :] <= positions[:, None], scores, HIDDEN)
    return scores


@gluon.jit
def _pool(scores, pooled, NEGATIVE_SCALE: gl.constexpr):
    """The running max-pool (min-pool for a negative scale) of a block's parts."""
    if NEGATIVE_SCALE:
        return gl.minimum(pooled, gl.min(scores, axis=1))
    return gl.maximum(pooled, gl.max(scores, axis=1))


@gluon.jit
def _select_rows(q_smem, k_smem, scale_smem, full, empty, IQ_SCALE, IDS, tile,
                 own_block, key_head, stride_iqs_t, stride_ids_t, stride_ids_h, scale,
                 G: gl.constexpr, TILE_TOKENS: gl.constexpr, BLOCK: gl.constexpr,
                 TOP_K: gl.constexpr, TOPK_SLOTS: gl.constexpr, NUM_LOCAL: gl.constexpr,
                 NUM_SINK: gl.constexpr, NEGATIVE_SCALE: gl.constexpr, K_CHUNKS: gl.constexpr,
                 KEYS: gl.constexpr, STAGES: gl.constexpr, HALF: gl.constexpr):
    """One consumer warpgroup: rows [64 HALF, 64 HALF + 64) of the tile through blocks
    0..own_block, each in BLOCK / KEYS parts of KEYS keys, then their kept ids. ``tile``: the
    tile's first query row in index_q and the ids, its first position, and its queries'
    positions [first_query, end_query)."""
    query_row0, first_position, first_query, end_query = tile
    NUM_WARPS: gl.constexpr = gl.num_warps()
    HALF_ROWS: gl.constexpr = 64
    KEY_PARTS: gl.constexpr = BLOCK // KEYS
    HIDDEN: gl.constexpr = float("inf") if NEGATIVE_SCALE else float("-inf")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, KEYS, 32])
    # The keys [rows, slots]: rows spread as the products' rows, so the pooled scores need
    # no data movement to meet them.
    k_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, TOPK_SLOTS, 32])
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    keys_rows: gl.constexpr = gl.SliceLayout(1, k_layout)

    rows = HALF * HALF_ROWS + gl.arange(0, HALF_ROWS, layout=rows_layout)
    positions = first_position + rows // G
    row_valid = (rows < G * TILE_TOKENS) & (positions >= first_query) & (positions < end_query)
    query_row = (query_row0 + rows // G).to(gl.int64)
    head = key_head * G + rows % G
    # One factor per row: the index scale times the row's scale.
    row_scale = scale * gl.load(IQ_SCALE + query_row * stride_iqs_t + head, mask=row_valid,
                                other=1.0)

    slots = gl.arange(0, TOPK_SLOTS, layout=gl.SliceLayout(0, k_layout)).to(gl.int64)
    # As select's: distinct very small keys in the empty slots, the largest key in padding
    # slots past TOP_K (never the row minimum).
    keys = gl.where(slots[None, :] < TOP_K, slots[None, :] - 0x7FFFFFFFFFFFFFFF,
                    0x7FFFFFFFFFFFFFFF)
    keys = gl.zeros((HALF_ROWS, TOPK_SLOTS), gl.int64, layout=k_layout) + keys

    no_scores = gl.zeros((HALF_ROWS, KEYS), gl.float32, layout=s_layout)
    no_pool = gl.full((HALF_ROWS,), HIDDEN, gl.float32, layout=rows_layout)
    # Part p of block u is issued before part p - 1 (or the previous block's last part) is
    # pooled and merged, which then runs while the tensor cores compute.
    accumulators = _issue_part(q_smem, k_smem, full, 0, 0, no_scores, K_CHUNKS, KEYS, STAGES,
                               HALF)
    scores = _part_scores(accumulators, scale_smem, empty, 0, 0, own_block, positions,
                          K_CHUNKS, KEYS, KEY_PARTS, BLOCK, STAGES, HIDDEN, s_layout)
    pooled = no_pool
    for part in gl.static_range(1, KEY_PARTS):
        accumulators = _issue_part(q_smem, k_smem, full, 0, part, no_scores, K_CHUNKS, KEYS,
                                   STAGES, HALF)
        pooled = _pool(scores, pooled, NEGATIVE_SCALE)
        scores = _part_scores(accumulators, scale_smem, empty, 0, part, own_block, positions,
                              K_CHUNKS, KEYS, KEY_PARTS, BLOCK, STAGES, HIDDEN, s_layout)
    for u in range(1, own_block + 1):
        accumulators = _issue_part(q_smem, k_smem, full, u, 0, no_scores, K_CHUNKS, KEYS,
                                   STAGES, HALF)
        block = u - 1
        forced = (own_block - block < NUM_LOCAL) | (block < NUM_SINK)
        pooled = gl.convert_layout(_pool(scores, pooled, NEGATIVE_SCALE) * row_scale, keys_rows)
        keys = _merge_block(keys, pooled, block, forced)
        scores = _part_scores(accumulators, scale_smem, empty, u, 0, own_block, positions,
                              K_CHUNKS, KEYS, KEY_PARTS, BLOCK, STAGES, HIDDEN, s_layout)
        pooled = no_pool
        for part in gl.static_range(1, KEY_PARTS):
            accumulators = _issue_part(q_smem, k_smem, full, u, part, no_scores, K_CHUNKS,
                                       KEYS, STAGES, HALF)
            pooled = _pool(scores, pooled, NEGATIVE_SCALE)
            scores = _part_scores(accumulators, scale_smem, empty, u, part, own_block,
                                  positions, K_CHUNKS, KEYS, KEY_PARTS, BLOCK, STAGES, HIDDEN,
                                  s_layout)

    # The own block (masked in _part_scores), always forced.
    pooled = gl.convert_layout(_pool(scores, pooled, NEGATIVE_SCALE) * row_scale, keys_rows)
    keys = _merge_block(keys, pooled, own_block,
                        gl.full([HALF_ROWS], True, gl.int1, layout=keys_rows))

    score_bits = (keys >> 32).to(gl.int32)
    unused = (keys < TOP_K - 0x7FFFFFFFFFFFFFFF) | (score_bits == -0x7F800001)
    block_ids = gl.where(unused, -1, 0x7FFFFFFF - keys.to(gl.int32))
    key_query_row = gl.convert_layout(query_row, keys_rows)
    key_head_of = gl.convert_layout(head, keys_rows)
    key_valid = gl.convert_layout(row_valid, keys_rows)
    gl.store(IDS + key_query_row[:, None] * stride_ids_t + key_head_of[:, None] * stride_ids_h
             + slots[None, :], block_ids, mask=key_valid[:, None] & (slots[None, :] < TOP_K))


@gluon.jit
def _select_fp8_hopper_kernel(
    IQ, k_desc, scale_desc, IQ_SCALE, IDS, CU_SEQLENS, SCHEDULE, query_start, query_end,
    num_keys, stride_iq_t, stride_iq_h, stride_iqs_t, stride_ids_t, stride_ids_h, scale,
    G: gl.constexpr, TILE_TOKENS: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
    TOP_K: gl.constexpr, TOPK_SLOTS: gl.constexpr, NUM_LOCAL: gl.constexpr,
    NUM_SINK: gl.constexpr, NEGATIVE_SCALE: gl.constexpr, K_CHUNKS: gl.constexpr,
    KEYS: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    """One program per (query tile, index key head), on select's schedule: the tile's index_q
    codes (IQ, [Tq, Hi, Di] e4m3) into shared memory in K_CHUNKS chunks of dims, then the
    loader warp (``_select_loads``) and the two consumer warpgroups (``_select_rows``). k_desc
    reads the key codes [T, Hik * Di] in [BLOCK, Di / K_CHUNKS] boxes, scale_desc the key
    scales transposed and flat ([Hik * T], padded) in [BLOCK] boxes; IQ_SCALE: [Tq, Hi]."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    ROWS: gl.constexpr = 128  # TILE_ROWS
    CHUNK: gl.constexpr = HEAD_DIM // K_CHUNKS
    io_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // CHUNK, CHUNK // 16],
                                               [NUM_WARPS, 1], [1, 0])
    entry = gl.program_id(0)
    key_head = gl.program_id(1)
    sequence = gl.load(SCHEDULE + 2 * entry)
    if sequence < 0:  # padding entry
        return
    tile = gl.load(SCHEDULE + 2 * entry + 1)
    seq_start = gl.load(CU_SEQLENS + sequence)
    seq_len = gl.load(CU_SEQLENS + sequence + 1) - seq_start
    # The queries are the packed tokens [query_start, query_end): positions [first, end) here.
    first_query = gl.maximum(query_start - seq_start, 0)
    end_query = gl.minimum(query_end - seq_start, seq_len)
    first_position = tile * TILE_TOKENS
    query_row0 = seq_start - query_start + first_position
    # Every token of the tile lies in one block: BLOCK is a multiple of TILE_TOKENS.
    own_block = first_position // BLOCK

    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, io_layout))
    dims = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, io_layout))
    position = first_position + rows // G
    valid = (rows < G * TILE_TOKENS) & (position >= first_query) & (position < end_query)
    codes = (IQ + (query_row0 + rows // G).to(gl.int64)[:, None] * stride_iq_t
             + (key_head * G + rows % G)[:, None] * stride_iq_h + dims[None, :])
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, CHUNK], gl.float8e4nv)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [K_CHUNKS, ROWS, CHUNK], q_layout)
    for chunk in gl.static_range(K_CHUNKS):
        q_smem.index(chunk).store(gl.load(codes + chunk * CHUNK, mask=valid[:, None],
                                          other=0.0))

    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [K_CHUNKS * STAGES, BLOCK, CHUNK],
                                       k_desc.layout)
    scale_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK], scale_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(full.index(stage), count=1)
        mbarrier.init(empty.index(stage), count=2)  # one arrival per consumer warpgroup
    fence_async_shared()
    tile_args = (query_row0, first_position, first_query, end_query)
    # The constants go in literally: a tuple bound to a name would turn them into tensors.
    gl.warp_specialize([
        (_select_rows, (q_smem, k_smem, scale_smem, full, empty, IQ_SCALE, IDS, tile_args,
                        own_block, key_head, stride_iqs_t, stride_ids_t, stride_ids_h, scale,
                        G, TILE_TOKENS, BLOCK, TOP_K, TOPK_SLOTS, NUM_LOCAL, NUM_SINK,
                        NEGATIVE_SCALE, K_CHUNKS, KEYS, STAGES, 0)),
        (_select_rows, (q_smem, k_smem, scale_smem, full, empty, IQ_SCALE, IDS, tile_args,
                        own_block, key_head, stride_iqs_t, stride_ids_t, stride_ids_h, scale,
                        G, TILE_TOKENS, BLOCK, TOP_K, TOPK_SLOTS, NUM_LOCAL, NUM_SINK,
                        NEGATIVE_SCALE, K_CHUNKS, KEYS, STAGES, 1)),
        (_select_loads, (k_desc, scale_desc, k_smem, scale_smem, full, empty, seq_start,
                         key_head, key_head * num_keys + seq_start, own_block + 1, BLOCK,
                         HEAD_DIM, K_CHUNKS, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def kernel_shape(head_dim: int, block_size: int, promote_dims: int) -> tuple[int, int]:
    """(K_CHUNKS, KEYS): chunks of ``promote_dims`` dims, each summed by the tensor cores into
    its own accumulator, and the keys per product, so that the accumulators of a part take
    128 registers a thread."""
    chunks = head_dim // promote_dims
    return chunks, min(block_size, 256 // chunks)


def topk_slots(top_k: int) -> int:
    """Slots of a row's top-k keys: a power of two, at least 8 (an MMA layout's columns)."""
    return max(8, triton.next_power_of_2(top_k))


def supported(index_q: torch.Tensor, top_k: int, block_size: int,
              heads_per_key_head: int) -> bool:
    """Whether ``select_fp8_hopper`` selects for these inputs: a Hopper GPU (and the Hopper
    kernels not ``sm90.disabled``), index head dim 64 or 128, blocks of 64 or 128 keys, at
    most MAX_TOPK_SLOTS slots and at most 64 index heads per index key head."""
    return (sm90._enabled and index_q.is_cuda
            and torch.cuda.get_device_capability(index_q.device)[0] == 9
            and index_q.shape[-1] in HEAD_DIMS and block_size in BLOCK_SIZES
            and topk_slots(top_k) <= MAX_TOPK_SLOTS and heads_per_key_head <= TILE_ROWS // 2)


def _descriptors(k_codes: torch.Tensor, k_scales: torch.Tensor, block_size: int,
                 k_chunks: int):
    """TMA descriptors of the key codes ([T, Hik, Di] as [T, Hik * Di] in [block, Di / k_chunks]
    boxes) and of the key scales ([T, Hik], transposed and flat, in [block] boxes; padded to
    16 bytes, as a tensor map's extent must be), and the flat scales."""
    total, heads, dim = k_codes.shape
    chunk = dim // k_chunks
    codes_layout = gl.NVMMASharedLayout.get_default_for([block_size, chunk], gl.float8e4nv)
    codes = TensorDescriptor(k_codes, [total, heads * dim], [heads * dim, 1],
                             [block_size, chunk], codes_layout)
    flat_scales = torch.zeros(-(-total * heads // 4) * 4, dtype=torch.float32,
                              device=k_scales.device)
    flat_scales[:total * heads] = k_scales.t().reshape(-1)  # [Hik * T]
    scales = TensorDescriptor(flat_scales, [flat_scales.numel()], [1], [block_size],
                              gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                   rank=1))
    return codes, scales, flat_scales


def select_fp8_hopper(q_codes, q_scales, k_codes, k_scales, cu_seqlens, schedule, ids, *,
                      tile_tokens: int, top_k: int, block_size: int, index_softmax_scale: float,
                      num_local_blocks: int, num_sink_blocks: int, query_start: int,
                      promote_dims: int | None = None):
    """Writes the kept block ids of the fp8 codes and scales (quantize.quantize_rows_e4m3_fused:
    q [Tq, Hi, Di] and [Tq, Hi], k [T, Hik, Di] and [T, Hik]) into ``ids`` [Tq, Hi, top_k];
    ``schedule``: query_tile_schedule's of ``tile_tokens`` tokens (a TILE_ROWS-row tile);
    ``supported(q_codes, top_k, block_size, Hi // Hik)`` must hold. ``promote_dims``: dims the
    tensor cores sum before an fp32 add (32 or 64; default configs.SELECT_HOPPER_PROMOTE_DIMS)."""
    from .configs import SELECT_HOPPER_PROMOTE_DIMS, SELECT_HOPPER_REGISTERS, SELECT_HOPPER_STAGES

    total, num_index_heads, head_dim = q_codes.shape
    num_key_heads = k_codes.shape[1]
    k_chunks, keys = kernel_shape(head_dim, block_size,
                                  promote_dims or SELECT_HOPPER_PROMOTE_DIMS)
    codes_desc, scales_desc, flat_scales = _descriptors(k_codes, k_scales, block_size, k_chunks)
    _select_fp8_hopper_kernel[(schedule.shape[0], num_key_heads)](
        q_codes, codes_desc, scales_desc, q_scales, ids, cu_seqlens, schedule, query_start,
        query_start + total, k_codes.shape[0], q_codes.stride(0), q_codes.stride(1),
        q_scales.stride(0), ids.stride(0), ids.stride(1), index_softmax_scale,
        G=num_index_heads // num_key_heads, TILE_TOKENS=tile_tokens, BLOCK=block_size,
        HEAD_DIM=head_dim, TOP_K=top_k, TOPK_SLOTS=topk_slots(top_k),
        NUM_LOCAL=num_local_blocks, NUM_SINK=num_sink_blocks,
        NEGATIVE_SCALE=index_softmax_scale < 0, K_CHUNKS=k_chunks, KEYS=keys,
        STAGES=SELECT_HOPPER_STAGES, CONSUMER_REGS=SELECT_HOPPER_REGISTERS[0],
        LOADER_REGS=SELECT_HOPPER_REGISTERS[1], num_warps=4,
        maxnreg=sm90._maxnreg(3, SELECT_HOPPER_REGISTERS))
    del flat_scales  # (alive through the launch)
    return ids
